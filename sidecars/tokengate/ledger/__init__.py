"""Billing: usage events, their cost, the usage ledger in Redis and its reports.

- ``event``        the usage event the edge writes (one JSON line per finished request)
- ``calculator``   the billing formula (cost per event, per model weights)
- ``tail``         reads the usage file across rotations, from a checkpoint
- ``ledger``       applies events to Redis exactly once
- ``store``        the ledger's Redis key layout
- ``service``      the ledger process (``tokengate-ledger``)
- ``report``       ``tokengate usage``: per key / model / day totals
"""
