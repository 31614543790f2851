"""Billing: usage events, their cost, the usage ledger in Redis and its reports.

- ``event``        the usage event the edge writes (one JSON line per finished request)
- ``engine_record`` the engine usage record the vLLM plugin writes (one per engine request)
- ``reconcile``    an event's engine records: when they are complete, what they bill
- ``calculator``   the billing formula (cost per event, per model weights)
- ``tail``         reads the usage file across rotations, from a checkpoint
- ``ledger``       applies events (and engine records) to Redis exactly once
- ``join``         the script's items: bills, waits and kept records, decided from Redis
- ``service``      the ledger process (``tokengate-ledger``)
- ``report``       ``tokengate usage``: per key / model / day totals
- ``admin``        the admin view: per key limits, budgets and spend (``GET /keys``)
"""
