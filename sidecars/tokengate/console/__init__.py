"""The operator console: keys, budgets, usage and spend per key, model and day, the
request log, traffic charts and the replicas, in a browser; a process of its own
(``tokengate-console``, ``tokengate.console.service``) on ``ledger.console.listen``,
behind admin logins (full admins, or read-only ones that change nothing).

- ``password``  admin password digests (``hashlib.scrypt``, parameters in the string)
- ``session``   server-side sessions with their CSRF tokens, the login limiter
- ``data``      what the pages show, from the ledger's Redis and the edges' status
                servers
- ``requests``  the usage files (the live one and its rotated siblings), newest first:
                the request log, one request's event
- ``traffic``   the usage events of the last hours per minute, kept up to date as the
                files grow: the Live page's refusals and charts
- ``charts``    the charts, SVG drawn by matplotlib on the server
- ``forms``     the key forms' fields, checked one by one
- ``changes``   key changes through ``tokengate keys``' own functions, direct or queued
                for a root helper; the audit stream
- ``app``       the WSGI application: routes, roles, security headers, pages (Jinja2)
- ``server``    its listener: a bounded pool of threads, read timeouts and deadlines
- ``service``   the process (``tokengate-console``)
- ``cli``       ``tokengate console passwd``, ``role`` and ``apply``
"""
