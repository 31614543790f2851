"""``tokengate console passwd`` against a running console that has no admin yet (as after
an upgrade from a configuration without one): the console, a process of its own, reads
the edited file at the next request; the new admin logs in at once, no restart."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from tokengate_dev import devstack
from tokenstorm.process import Service, free_port

from tests.fixtures_ledger import svc_name

PASSWORD = "a console test password"


def console_answers(url: str) -> bool:
    """Whether the console at ``url`` (``http://host:port``) serves its login page."""
    try:
        return httpx.get(f"{url}/login", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def log_in(url: str, name: str, password: str) -> httpx.Response:
    """The console's login form at ``url`` sent as a browser sends it (its token in the
    form and in the login cookie, which is Secure: sent by hand over plain HTTP, as a
    browser does to 127.0.0.1)."""
    token = re.search(r'name="csrf" value="([^"]+)"', httpx.get(f"{url}/login").text)
    assert token is not None
    return httpx.post(f"{url}/login", data={"name": name, "password": password,
                                            "csrf": token[1], "next": "/keys"},
                      headers={"Origin": url, "Cookie": f"tg_console_login={token[1]}"})


@pytest.fixture
def console_without_admin(config_path: Path, redis_url: str,
                          tmp_path: Path) -> Iterator[tuple[Path, str, Service]]:
    """A running console whose configuration names no admin; its address."""
    raw = yaml.safe_load(config_path.read_text())
    listen = f"127.0.0.1:{free_port()}"
    raw["redis"]["url"] = redis_url
    raw["ledger"]["console"] = {"listen": listen}
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    console = devstack.console_service(path, tmp_path / "usage.jsonl",
                                       name=svc_name("test-console-passwd")).start()
    try:
        yield path, f"http://{listen}", console
    finally:
        console.stop()


def test_an_admin_set_by_console_passwd_logs_in_to_a_running_console_at_once(
        console_without_admin: tuple[Path, str, Service]) -> None:
    path, url, console = console_without_admin
    assert "No admin yet" in httpx.get(f"{url}/login").text
    assert log_in(url, "alice", PASSWORD).status_code == 401
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "console", "passwd", "alice",
                        "--password-stdin", "--config", str(path)], input=PASSWORD + "\n",
                       capture_output=True, text=True, timeout=60, check=False)
    assert (r.returncode, r.stderr) == (0, (
        f"admin alice: password set ({path}); the console (tokengate-console) serves "
        f"{url}/\n"))
    login = log_in(url, "alice", PASSWORD)
    assert (login.status_code, login.headers["location"]) == (303, "/keys")
    assert console.proc is not None and console.proc.poll() is None  # the same process
