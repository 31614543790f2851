"""``tokengate console passwd`` against a running ledger whose console is off (no admin
yet, as after an upgrade from a configuration without one): the ledger reads the edited
file and starts serving the console, no restart; the new admin logs in."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from tokengate.process import Service, free_port
from tokengate_dev import devstack

from tests.fixtures_ledger import svc_name, wait_until

PASSWORD = "a console test password"


def console_answers(url: str) -> bool:
    """Whether the console at ``url`` (``http://host:port``) serves its login page."""
    try:
        return httpx.get(f"{url}/login", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def ledger_without_console(config_path: Path, redis_url: str,
                           tmp_path: Path) -> Iterator[tuple[Path, str, Service]]:
    """A running ledger whose configuration names no admin; its console's address."""
    raw = yaml.safe_load(config_path.read_text())
    listen = f"127.0.0.1:{free_port()}"
    raw["redis"]["url"] = redis_url
    raw["ledger"]["console"] = {"listen": listen}
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    ledger = devstack.ledger_service(path, tmp_path / "usage.jsonl",
                                     name=svc_name("test-console-passwd-ledger")).start()
    try:
        yield path, listen, ledger
    finally:
        ledger.stop()


def test_console_passwd_starts_the_console_of_a_running_ledger_without_a_restart(
        ledger_without_console: tuple[Path, str, Service]) -> None:
    path, listen, ledger = ledger_without_console
    url = f"http://{listen}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/login", timeout=2)
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "console", "passwd", "alice",
                        "--password-stdin", "--config", str(path)], input=PASSWORD + "\n",
                       capture_output=True, text=True, timeout=60, check=False)
    assert (r.returncode, r.stderr) == (0, (
        f"admin alice: password set ({path}); a running tokengate-ledger serves the "
        f"console on {url}/ within a second\n"))
    wait_until(lambda: console_answers(url), 20, what="the console of the running ledger")
    token = re.search(r'name="csrf" value="([^"]+)"', httpx.get(f"{url}/login").text)
    assert token is not None
    # the login cookie is Secure: sent by hand over plain HTTP, as a browser does to
    # 127.0.0.1
    login = httpx.post(f"{url}/login", data={"name": "alice", "password": PASSWORD,
                                             "csrf": token[1], "next": "/keys"},
                       headers={"Origin": url, "Cookie": f"tg_console_login={token[1]}"})
    assert (login.status_code, login.headers["location"]) == (303, "/keys")
    assert ledger.proc is not None and ledger.proc.poll() is None  # the same process
