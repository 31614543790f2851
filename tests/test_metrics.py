"""The sidecars' metrics port (tokengate.metrics) and the ledger's admin view on it."""

from __future__ import annotations

import httpx
import pytest
from tokengate import metrics
from tokenstorm.process import free_port

pytestmark = pytest.mark.unit


def test_the_admin_view_answers_only_its_own_host_names() -> None:
    """A DNS-rebinding page reaches the port from the browser's own loopback, with its
    own host name in Host: 421, and no key names."""
    port = free_port()
    views = {"/keys": (200, {"keys": [{"name": "demo"}]})}
    assert metrics.serve(f"127.0.0.1:{port}", "test-admin-host", admin=views.get)
    base = f"http://127.0.0.1:{port}"
    rebound = httpx.get(f"{base}/keys", headers={"Host": f"rebind.example:{port}"},
                        timeout=10)
    assert (rebound.status_code, rebound.json()) == (421, {
        "error": f"the admin view does not answer to host 'rebind.example:{port}': ask "
                 f"for 127.0.0.1:{port}"})
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        r = httpx.get(f"{base}/keys", headers={"Host": host}, timeout=10)
        assert (r.status_code, r.json()) == (200, {"keys": [{"name": "demo"}]})
    # Prometheus's own scrape names its target as it likes
    assert httpx.get(f"{base}/metrics", headers={"Host": "prometheus-target:1"},
                     timeout=10).status_code == 200
