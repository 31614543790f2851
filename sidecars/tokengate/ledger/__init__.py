"""The Redis side of tokengate: usage events, billing, the usage ledger, global limits.

- ``event``        the usage event the edge writes (one JSON line per finished request)
- ``calculator``   the billing formula (cost per event, per model weights)
- ``tail``         reads the usage file across rotations, from a checkpoint
- ``ledger``       applies events to Redis exactly once (``tokengate-ledger``)
- ``report``       ``tokengate usage``: per key / model / day totals
- ``global_limit`` the sliding-window RPM/TPM script shared by all edges
- ``limits_server`` the gRPC sidecar in front of it (``tokengate-limits``)
- ``sampling``     the tiered access-log sampling rule the edge implements
"""
