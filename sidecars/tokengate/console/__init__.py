"""The operator console: keys, budgets, usage and spend per key, model and day, and the
replicas, in a browser; served by the ledger process (``tokengate-ledger``) on a listener
of its own (``ledger.console``), behind admin logins.

- ``password``  admin password digests (``hashlib.scrypt``, parameters in the string)
- ``session``   server-side sessions with their CSRF tokens, the login limiter
- ``data``      what the pages show, from the ledger's Redis, the edges' status
                servers and the usage file
- ``charts``    the usage charts, SVG drawn by matplotlib on the server
- ``forms``     the key forms' fields, checked one by one
- ``changes``   key changes through ``tokengate keys``' own functions, direct or queued
                for a root helper; the audit stream
- ``app``       the WSGI application: routes, security headers, pages (Jinja2)
- ``server``    its listener (a thread of the ledger)
- ``cli``       ``tokengate console passwd`` and ``tokengate console apply``
"""

from tokengate.console.server import serve

__all__ = ["serve"]
