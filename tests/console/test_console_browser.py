"""The operator console in a real browser: Debian's chromium, headless, driven by
Selenium through Debian's chromedriver (never a downloaded one), against the real
stack: the session's vLLM and counter, a real nginx edge with global limits, the limits
sidecar, the ledger and the console (``tokengate-console``, a process of its own) on a
Redis of this module.

Every page is saved as a screenshot under ``var/screenshots/console-<page>.png``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml
from tokengate.ledger import report
from tokengate_dev import devstack
from tokenstorm.process import free_port

from tests.conftest import MODEL, TEST_DIR, key_digest
from tests.console.test_console_unit import admin_digest
from tests.fixtures_edge import EDGE_DIR, VARIANT_PORTS, Edge, _edge_yaml, _start_edge
from tests.fixtures_ledger import svc_name, wait_until

SCREENSHOTS = devstack.ROOT / "var" / "screenshots"
ADMIN, PASSWORD = "ops-admin", "a console test password"
DEMO_KEY = "tg-demo-key"
LIMITS_SOCKET = TEST_DIR / "console-limits.sock"


@dataclass
class Stack:
    url: str                 # the console, http://127.0.0.1:<port>
    edge: Edge
    config: Path
    redis_url: str
    client: redis.Redis


@pytest.fixture(scope="module")
def stack(config_path: Path, counter_addr: str, vllm_url: str) -> Iterator[Stack]:
    started: list[Any] = []
    port = free_port()
    redis_svc = devstack.redis_service(port=port, name=svc_name("test-console-redis"))
    started.append(redis_svc.start())
    redis_url = f"redis://127.0.0.1:{port}/0"
    console_port = free_port()
    edge_port = next(VARIANT_PORTS)
    name = "console"

    def edit(raw: dict[str, Any]) -> None:
        raw["keys"] = {"demo": {"sha256": key_digest(DEMO_KEY), "rpm": 600, "tpm": 200000}}
        raw["redis"] = {"url": redis_url, "timeout_ms": 2000}
        raw["global_limits"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                                "unix_socket": str(LIMITS_SOCKET)}
        raw["edge"]["global_limits_timeout_ms"] = 5000
        raw["ledger"] = {"console": {
            "listen": f"127.0.0.1:{console_port}",
            "admins": {ADMIN: admin_digest(PASSWORD)},
            "edges": [str(EDGE_DIR / f"test-nginx-{name}")],
            "edge_status": [f"127.0.0.1:{edge_port + 150}"]}}

    usage = EDGE_DIR / name / "usage.jsonl"
    for f in usage.parent.glob("usage.jsonl*"):   # rotated ones of an earlier run too
        f.unlink()
    path = _edge_yaml(config_path, EDGE_DIR / name / "tokengate.yaml", edit, usage)
    raw = yaml.safe_load(path.read_text())
    try:
        Path(f"{LIMITS_SOCKET}.0").unlink(missing_ok=True)
        limits = devstack.limits_service(path, int(raw["global_limits"]["listen"].split(":")[1]),
                                         redis_url, unix_socket=LIMITS_SOCKET, workers=1,
                                         name=svc_name("test-console-limits"))
        started.append(limits.start())
        wait_until(lambda: Path(f"{LIMITS_SOCKET}.0").exists(), 20, what="the limits socket")
        edge = _start_edge(path, edge_port, f"test-nginx-{name}", TEST_DIR / "counter.sock",
                           usage)
        assert edge.status_port == edge_port + 150
        started.append(edge.service)
        ledger = devstack.ledger_service(path, usage, redis_url,
                                         name=svc_name("test-console-ledger"))
        started.append(ledger.start())
        # its own process, as make run and the unit start it: ready once /login answers
        console = devstack.console_service(path, usage, redis_url,
                                           name=svc_name("test-console"))
        started.append(console.start())
        url = f"http://127.0.0.1:{console_port}"
        yield Stack(url, edge, path, redis_url, redis.Redis.from_url(redis_url,
                                                                     decode_responses=True))
    finally:
        for svc in reversed(started):
            svc.stop()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    profile = tempfile.mkdtemp(prefix="tg-console-chromium-")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(chromium: Any, stack: Stack) -> Any:
    """The module's browser, logged in (the first test that asks logs in through the
    login page)."""
    if chromium.get_cookie("tg_console") is None:
        login(chromium, stack)
    return chromium


def shot(driver: Any, page: str, width: int = 1280) -> None:
    """The whole page, ``width`` px wide, as var/screenshots/console-<page>.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    metrics = {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": width < 600}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {**metrics, "height": min(max(int(height), 600), 4000)})
    driver.save_screenshot(str(SCREENSHOTS / f"console-{page}.png"))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def by_id(driver: Any, element: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element)


def submit(driver: Any, button: str) -> None:
    """Click ``button`` and wait for the page it loads (the old one gone)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")

    def gone(_: Any) -> bool:
        try:
            _ = old.tag_name
        except WebDriverException:  # stale, or "does not belong to the document"
            return True
        return False

    by_id(driver, button).click()
    WebDriverWait(driver, 60).until(gone)


def fill(driver: Any, **fields: str) -> None:
    for name, value in fields.items():
        el = by_id(driver, f"f-{name}" if name not in ("confirm",) else name)
        el.clear()
        if value:
            el.send_keys(value)


def login(driver: Any, stack: Stack) -> None:
    driver.get(f"{stack.url}/keys")
    assert driver.current_url == f"{stack.url}/login?next=%2Fkeys"
    shot(driver, "login")
    by_id(driver, "name").send_keys(ADMIN)
    by_id(driver, "password").send_keys(PASSWORD)
    submit(driver, "login")
    assert driver.current_url == f"{stack.url}/keys", driver.page_source[-1500:]


def chat(key: str, edge: Edge, session: str | None = None) -> Any:
    client = openai.OpenAI(base_url=edge.base_url, api_key=key, max_retries=0, timeout=60,
                           default_headers={"X-Session-Id": session} if session else None)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4)


def usage_json(stack: Stack, key: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--json", "--config",
                        str(stack.config), "--key", key], capture_output=True, text=True,
                       timeout=60, check=True)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def test_a_page_without_a_session_goes_to_the_login(stack: Stack) -> None:
    r = httpx.get(f"{stack.url}/usage")
    assert (r.status_code, r.headers["location"]) == (303, "/login?next=%2Fusage")
    r = httpx.post(f"{stack.url}/keys/new", data={"name": "x", "rpm": "1", "tpm": "1"},
                   headers={"Origin": stack.url})
    assert r.status_code == 403


def test_the_demo_keys_spend_is_what_tokengate_usage_says(stack: Stack, browser: Any) -> None:
    for _ in range(3):  # one agent session
        assert chat(DEMO_KEY, stack.edge, "agent-run-1").usage.completion_tokens == 4
    wait_until(lambda: sum(r.requests for r in report.query(stack.client, key_id="demo")) == 3,
               30, what="the ledger to bill the 3 requests")
    cli = usage_json(stack, "demo")["total"]
    assert cli["requests"] == 3 and cli["cost"] > 0
    browser.get(f"{stack.url}/keys")
    cookie = browser.get_cookie("tg_console")
    assert (cookie["httpOnly"], cookie["secure"], cookie["sameSite"]) == (True, True, "Strict")
    shot(browser, "keys")
    shot(browser, "keys-390", width=390)
    browser.get(f"{stack.url}/keys/demo")
    from selenium.webdriver.common.by import By

    cell = browser.find_element(By.CSS_SELECTOR, "#key-usage td[data-cost]")
    assert float(cell.get_attribute("data-cost")) == pytest.approx(cli["cost"], abs=1e-12)
    assert cell.text == f"{cli['cost']:.9f}".rstrip("0").rstrip(".")
    # the key's sessions: the one session, with the same totals
    row = browser.find_elements(By.CSS_SELECTOR, "#key-sessions tbody tr")
    assert len(row) == 1
    cells = row[0].find_elements(By.TAG_NAME, "td")
    assert [c.text for c in cells[:1] + cells[3:7]] == [
        "agent-run-1", "3", f"{cli['prompt_tokens']:,}", f"{cli['cached_tokens']:,}",
        f"{cli['completion_tokens']:,}"]
    assert float(cells[7].get_attribute("data-cost")) == pytest.approx(cli["cost"], abs=1e-12)
    shot(browser, "key")
    browser.get(f"{stack.url}/usage")
    total = by_id(browser, "total-cost")
    assert float(total.get_attribute("data-cost")) == pytest.approx(cli["cost"], abs=1e-12)
    images = browser.find_elements(By.CSS_SELECTOR, ".charts img")
    assert len(images) == 3
    assert all(browser.execute_script("return arguments[0].naturalWidth", img) > 100
               for img in images)  # the SVG charts render under the page's CSP
    shot(browser, "usage")
    csv = httpx.get(f"{stack.url}/usage.csv", headers={"Cookie": f"tg_console={cookie['value']}"})
    assert csv.status_code == 200 and csv.headers["content-type"] == "text/csv; charset=utf-8"
    lines = csv.text.splitlines()
    assert lines[0] == ("day,key,model,requests,errors,prompt_tokens,cached_tokens,"
                        "completion_tokens,cost")
    assert lines[1].split(",")[1:4] == ["demo", MODEL, "3"]
    assert float(lines[1].split(",")[-1]) == pytest.approx(cli["cost"], abs=1e-12)


def test_a_key_made_in_the_console_works_then_a_budget_and_a_revoke_refuse_it(
        stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{stack.url}/keys/new")
    fill(browser, name="team-a", rpm="100", tpm="100000")
    shot(browser, "new")
    submit(browser, "create")
    key = by_id(browser, "new-key").text
    assert re.fullmatch(r"tg-[A-Za-z0-9_-]{43}", key)
    assert key not in stack.config.read_text()
    assert "Applied to the edge" in by_id(browser, "applied").text
    shot(browser, "created")
    assert chat(key, stack.edge).usage.completion_tokens == 4

    browser.get(f"{stack.url}/keys/team-a")
    fill(browser, budgets="day=5t")
    submit(browser, "save")
    assert "Applied to the edge" in by_id(browser, "applied").text
    assert "of 5 tokens" in by_id(browser, "budgets").text
    with pytest.raises(openai.RateLimitError) as refused:
        chat(key, stack.edge)
    assert refused.value.body["code"] == "insufficient_quota"

    fill(browser, confirm="team-a")
    submit(browser, "revoke")
    assert by_id(browser, "notice").text == "Key team-a revoked."
    with pytest.raises(openai.AuthenticationError) as gone:
        chat(key, stack.edge)
    assert gone.value.status_code == 401
    assert "team-a" not in yaml.safe_load(stack.config.read_text())["keys"]
    assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-key="team-a"]') == []

    entries = [f for _id, f in stack.client.xrange("tg:{ledger}:audit")
               if f.get("kind") == "console"]
    assert [(e["admin"], e["action"], e["key"], e["result"]) for e in entries] == [
        (ADMIN, "login", "", "ok"), (ADMIN, "key_created", "team-a", "ok"),
        (ADMIN, "key_changed", "team-a", "ok"), (ADMIN, "key_revoked", "team-a", "ok")]
    assert json.loads(entries[2]["detail"])["budgets"] == ["day=5t"]
    # its usage stays reachable: the Usage filter lists the revoked key
    wait_until(lambda: usage_json(stack, "team-a")["total"]["requests"] >= 1, 30,
               what="the ledger billing team-a")
    browser.get(f"{stack.url}/usage")
    keys = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#key option")]
    assert keys == ["every key", "demo", "team-a"]


def test_a_change_without_the_csrf_token_or_from_another_origin_is_refused(
        stack: Stack, browser: Any) -> None:
    browser.get(f"{stack.url}/keys/new")
    csrf = browser.find_element("name", "csrf").get_attribute("value")
    cookie = {"Cookie": f"tg_console={browser.get_cookie('tg_console')['value']}"}
    form = {"name": "sneaky", "rpm": "1", "tpm": "1"}
    for data, origin in ((form, stack.url), ({**form, "csrf": "x" * 43}, stack.url),
                         ({**form, "csrf": csrf}, "http://evil.example")):
        r = httpx.post(f"{stack.url}/keys/new", data=data,
                       headers={**cookie, "Origin": origin})
        assert r.status_code == 403
    assert "sneaky" not in yaml.safe_load(stack.config.read_text())["keys"]


def test_bad_input_is_answered_with_a_message_per_field(stack: Stack, browser: Any) -> None:
    browser.get(f"{stack.url}/keys/new")
    fill(browser, name="demo", rpm="12x", tpm="0", budgets="tiny-qwen3:day=-1", models="gpt-9")
    submit(browser, "create")
    assert by_id(browser, "e-name").text == \
        "a key named 'demo' exists: change it, or revoke it first"
    assert by_id(browser, "e-rpm").text == "'12x' is not a whole number: requests per minute"
    assert by_id(browser, "e-tpm").text == "tokens per minute: from 1 to 1,000,000,000,000"
    assert by_id(browser, "e-models").text.startswith("not a served model: 'gpt-9'")
    assert by_id(browser, "e-budgets").text == "a budget is not negative: 'tiny-qwen3:day=-1'"
    shot(browser, "new-errors")
    fill(browser, name="ok name!", rpm="1", tpm="1", budgets="", models="")
    submit(browser, "create")
    assert by_id(browser, "e-name").text.startswith("'ok name!': a key id is 1-64 letters")
    keys = yaml.safe_load(stack.config.read_text())["keys"]
    assert list(keys) == ["demo"]


def test_the_live_page_shows_the_replica_and_the_refusals(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    r = httpx.post(f"{stack.edge.base_url}/chat/completions",
                   headers={"Authorization": f"Bearer {DEMO_KEY}"},
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    stack.edge.event(r.headers["x-request-id"])
    browser.get(f"{stack.url}/live")
    rows = browser.find_elements(By.CSS_SELECTOR, "#replicas tbody tr")
    assert rows, browser.find_element(By.TAG_NAME, "main").text
    row = rows[0]
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == MODEL and cells[2] == "healthy"
    reasons = {r.get_attribute("data-reason"): r.find_elements(By.TAG_NAME, "td")[1].text
               for r in browser.find_elements(By.CSS_SELECTOR, "#refusals tr[data-reason]")}
    assert reasons.get("model_not_found") == "404"
    assert reasons.get("insufficient_quota") == "429"  # the budget's refusal above
    shot(browser, "live")


def test_a_stale_save_is_refused_409_with_what_changed_and_audited(
        stack: Stack, browser: Any) -> None:
    """The trial's lost update: a `keys set` of TPM and a budget, then a console save of
    RPM from a page loaded before it: nothing of the command line's change is lost."""
    from selenium.webdriver.common.by import By

    browser.get(f"{stack.url}/keys/demo")
    subprocess.run([sys.executable, "-m", "tokengate.cli", "keys", "set", "demo", "--tpm",
                    "150000", "--budget", "day=3", "--config", str(stack.config),
                    "--no-apply"], capture_output=True, check=True, timeout=60)
    fill(browser, rpm="500")
    submit(browser, "save")
    stale = {r.get_attribute("data-field"): [c.text for c in
                                             r.find_elements(By.TAG_NAME, "td")[1:]]
             for r in browser.find_elements(By.CSS_SELECTOR, "#stale tr[data-field]")}
    assert stale == {"tpm": ["200000", "150000"], "budgets": ["(none)", "day=3"]}
    shot(browser, "key-stale")
    demo = yaml.safe_load(stack.config.read_text())["keys"]["demo"]
    assert (demo["rpm"], demo["tpm"], demo["budgets"]) == (
        600, 150000, [{"period": "day", "spend": 3.0}])
    # the form now shows the key as it is: saved, only the RPM changes
    assert by_id(browser, "f-tpm").get_attribute("value") == "150000"
    fill(browser, rpm="500")
    submit(browser, "save")
    assert browser.current_url == f"{stack.url}/keys/demo"
    assert "Applied to the edge" in by_id(browser, "applied").text
    demo = yaml.safe_load(stack.config.read_text())["keys"]["demo"]
    assert (demo["rpm"], demo["tpm"], demo["budgets"]) == (
        500, 150000, [{"period": "day", "spend": 3.0}])
    browser.get(f"{stack.url}/audit")
    rows = [[c.text for c in r.find_elements(By.TAG_NAME, "td")]
            for r in browser.find_elements(By.CSS_SELECTOR, "#audit tr[data-id]")]
    assert [(r[2], r[3], r[4], r[6]) for r in rows[:2]] == [
        (ADMIN, "key_changed", "demo", "ok"),
        (ADMIN, "key_changed", "demo", "refused: stale form: changed since tpm, budgets")]
    shot(browser, "audit")


# --- the request log, Live's charts, the phone layout, read-only admins ------------------

PHONE = 375    # px: an iPhone SE / mini's CSS width


def width(driver: Any, px: int) -> None:
    """Lay the page out ``px`` CSS pixels wide (a phone below 600 px), until
    ``desktop``."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": px, "height": 800, "deviceScaleFactor": 1, "mobile": px < 600})


def desktop(driver: Any) -> None:
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def overflow(driver: Any) -> dict[str, int]:
    """What sticks out of the page's width: the document's scroll width against its
    client width, and the rightmost edge of any element (a wide table or chart counts
    only through the box it scrolls in)."""
    return driver.execute_script("""
        const d = document.documentElement;
        let right = 0;
        for (const e of document.querySelectorAll('body *')) {
            if (e.parentElement.closest('.scroll, .charts figure')) continue;
            right = Math.max(right, e.getBoundingClientRect().right);
        }
        return {scroll: d.scrollWidth, client: d.clientWidth, right: Math.ceil(right)};
    """)


def post_edge(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.edge.base_url}/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {DEMO_KEY}"})


def rotate_usage(stack: Stack) -> Path:
    """The usage file renamed to usage.jsonl.1 and nginx told to reopen (SIGUSR1), as
    logrotate does it; returns the renamed file once a new line went to the new one."""
    usage = stack.edge.usage_file
    rotated = usage.with_name(usage.name + ".1")
    usage.rename(rotated)
    prefix = Path(stack.edge.service.argv[stack.edge.service.argv.index("-p") + 1])
    os.kill(int((prefix / "nginx.pid").read_text()), signal.SIGUSR1)
    hello = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    wait_until(lambda: usage.exists() and post_edge(stack, hello).headers["x-request-id"]
               in usage.read_text(), 30, step_s=0.2, what="a line in the reopened file")
    return rotated


def test_the_request_log_lists_both_files_of_a_rotation_and_opens_a_request(
        stack: Stack, browser: Any) -> None:
    """A refusal written before a real rotation (rename, nginx reopen) and a request
    after it: the log lists both, newest first, filters them, and opens one with its
    fields; Live counts the rotated file's refusal (it once read only the live file)."""
    from selenium.webdriver.common.by import By

    refused = post_edge(stack, {"model": "gone-model", "messages": [
        {"role": "user", "content": "x"}]})
    assert refused.status_code == 404
    refused_id = refused.headers["x-request-id"]
    stack.edge.event(refused_id)
    rotated = rotate_usage(stack)
    assert refused_id in rotated.read_text()
    ok = post_edge(stack, {"model": MODEL, "max_tokens": 3,
                           "messages": [{"role": "user", "content": "Hello there"}]})
    assert ok.status_code == 200
    ok_event = stack.edge.event(ok.headers["x-request-id"])

    browser.get(f"{stack.url}/requests")
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr[data-request]")
    shown = [r.get_attribute("data-request") for r in rows]
    assert shown[0] == ok_event["request_id"] and refused_id in shown
    cells = [c.text for c in rows[0].find_elements(By.TAG_NAME, "td")]
    assert cells[2:8] == ["demo", MODEL, "chat", "200", str(ok_event["prompt_tokens"]),
                          str(ok_event["completion_tokens"])]
    shot(browser, "requests")
    # the refusals only, with their reason; then one opened
    by_id(browser, "status").send_keys("refused")
    submit(browser, "filter")
    assert browser.current_url == f"{stack.url}/requests?key=&model=&status=refused"
    refusals = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr[data-request]")
    assert all(int(r.get_attribute("data-status")) >= 400 for r in refusals)
    row = next(r for r in refusals if r.get_attribute("data-request") == refused_id)
    assert row.find_elements(By.TAG_NAME, "td")[-1].text == "model_not_found"
    old = browser.find_element(By.TAG_NAME, "html")
    row.find_element(By.CSS_SELECTOR, "a").click()
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 60).until(expected_conditions.staleness_of(old))
    fields = {r.get_attribute("data-field"): r.find_element(By.TAG_NAME, "td").text
              for r in browser.find_elements(By.CSS_SELECTOR, "#event tr[data-field]")}
    # a model that is not served is not recorded (null, as JSON)
    assert (fields["request_id"], fields["status"], fields["error"], fields["model"]) == \
        (refused_id, "404", "model_not_found", "null")
    shot(browser, "request")
    shot(browser, "request-375", width=PHONE)
    browser.get(f"{stack.url}/live")
    reasons = {r.get_attribute("data-reason") for r in
               browser.find_elements(By.CSS_SELECTOR, "#refusals tr[data-reason]")}
    assert "model_not_found" in reasons


def test_live_draws_the_last_hours_per_minute_and_reloads_itself(
        stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    hello = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    stack.edge.event(post_edge(stack, hello).headers["x-request-id"])
    browser.get(f"{stack.url}/live?range=1h&refresh=2")
    images = browser.find_elements(By.CSS_SELECTOR, ".charts img")
    assert [i.get_attribute("alt").split(" per ")[0] for i in images] == \
        ["Requests", "Tokens", "Latency"]
    assert all(browser.execute_script("return arguments[0].naturalWidth", i) > 100
               for i in images)   # the SVG charts render under the page's CSP
    assert int(by_id(browser, "total-requests").text.replace(",", "")) >= 1
    # the page reloads itself (a meta refresh: no script runs)
    old = browser.find_element(By.TAG_NAME, "html")
    WebDriverWait(browser, 30).until(expected_conditions.staleness_of(old))
    assert browser.current_url == f"{stack.url}/live?range=1h&refresh=2"
    browser.get(f"{stack.url}/live?range=24h&refresh=off")
    assert by_id(browser, "range-24h").get_attribute("aria-current") == "page"
    assert browser.find_elements(By.CSS_SELECTOR, 'meta[http-equiv="refresh"]') == []
    shot(browser, "live")
    shot(browser, "live-375", width=PHONE)


def test_every_page_fits_a_phone_and_a_desktop_without_scrolling_sideways(
        stack: Stack, browser: Any) -> None:
    """At 375 px no page is wider than the screen (a wide table scrolls inside its own
    box), and the keys' budgets column keeps its content's width (it was 86 px)."""
    from selenium.webdriver.common.by import By

    subprocess.run([sys.executable, "-m", "tokengate.cli", "keys", "create", "phone-team",
                    "--rpm", "60", "--tpm", "100000", "--budget", "day=5",
                    "--budget", "month=120000t", "--config", str(stack.config),
                    "--no-apply"], capture_output=True, check=True, timeout=60)
    hello = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    rid = post_edge(stack, hello).headers["x-request-id"]
    stack.edge.event(rid)
    pages = ["/keys", "/keys/phone-team", "/keys/new", "/usage", "/live?refresh=off",
             "/requests", f"/requests/{rid}", "/batches", "/audit"]
    try:
        for px in (PHONE, 1280):
            width(browser, px)
            for page in pages:
                browser.get(f"{stack.url}{page}")
                got = overflow(browser)
                # the client width is the screen's, less a desktop's scroll bar
                assert px - 20 <= got["client"] <= px, (px, page, got)
                assert got["scroll"] <= got["client"] and got["right"] <= got["client"], \
                    (px, page, got)
            width(browser, PHONE)
            browser.get(f"{stack.url}/keys")
            cell = browser.find_element(By.CSS_SELECTOR,
                                        'tr[data-key="phone-team"] td:last-child')
            sizes = browser.execute_script("""
                const td = arguments[0], box = td.closest('.scroll');
                const spans = [...td.querySelectorAll('.budget')];
                return {cell: td.getBoundingClientRect().width,
                        budget: Math.max(...spans.map(s => s.scrollWidth)),
                        lines: Math.max(...spans.map(s => s.getClientRects().length)),
                        box: box.clientWidth, inside: box.scrollWidth};""", cell)
            # one line per budget, the column as wide as it, the table scrolling inside
            assert sizes["lines"] == 1 and sizes["cell"] >= sizes["budget"] > 150, sizes
            assert sizes["inside"] > sizes["box"], sizes
    finally:
        desktop(browser)
    shot(browser, "keys-375", width=PHONE)


def test_a_read_only_admin_sees_the_pages_without_forms_and_changes_nothing(
        stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "console", "passwd",
                        "viewer", "--role", "read-only", "--password-stdin", "--config",
                        str(stack.config)], input=PASSWORD + "\n", capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    browser.delete_all_cookies()
    browser.get(f"{stack.url}/login?next=%2Fkeys%2Fdemo")
    by_id(browser, "name").send_keys("viewer")
    by_id(browser, "password").send_keys(PASSWORD)
    submit(browser, "login")
    assert browser.current_url == f"{stack.url}/keys/demo"
    assert by_id(browser, "who").text == "viewer (read-only)"
    assert by_id(browser, "read-only").text.startswith("You are a read-only admin")
    forms = [f.get_attribute("action") for f in
             browser.find_elements(By.CSS_SELECTOR, 'form[method="post"]')]
    assert forms == [f"{stack.url}/logout"]
    shot(browser, "key-read-only")
    csrf = browser.find_element(By.NAME, "csrf").get_attribute("value")
    cookie = {"Cookie": f"tg_console={browser.get_cookie('tg_console')['value']}",
              "Origin": stack.url}
    before = stack.config.read_text()
    r = httpx.post(f"{stack.url}/keys/demo/disable", data={"csrf": csrf}, headers=cookie)
    assert r.status_code == 403 and "viewer is a read-only admin" in r.text
    assert stack.config.read_text() == before
    browser.delete_all_cookies()   # the module's browser logs in again as the admin
