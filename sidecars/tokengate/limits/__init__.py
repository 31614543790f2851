"""Admission-time limits that every edge node shares, in Redis.

- ``window``  the sliding-window RPM/TPM reservation (one atomic Redis script a call)
- ``budget``  the keys' budgets: spend and tokens per UTC day / month (one atomic
              Redis script a call)
- ``server``  the gRPC sidecar in front of both (``tokengate-limits``)

Each edge also keeps a per-node tier of its own (in ``lua/``); this one is consulted
after it when ``global_limits.enabled``.
"""
