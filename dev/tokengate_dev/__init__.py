"""Development tooling of a tokengate checkout (not part of the runtime package).

- ``devstack``          the loopback stack ``make run`` and the test fixtures start
- ``bench``             ``make bench`` (TokenStorm, gateway vs direct) and ``make bench-counter``
- ``build_tiny_model``  the embedded model ``scripts/setup.sh`` builds under ``var/models``
"""
