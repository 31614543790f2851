"""``tokengate doctor`` and ``tokengate-counter --check-upstreams``: every upstream is
checked against what the counter mirrors and billing reads (model name, vLLM release,
--enable-prompt-tokens-details, the tool parser, the tokengate plugin's engine records
in a file the ledger reads, counts equal to vLLM's /tokenize; with prefix routing, vLLM's
cache settings and the KV events of each replica that publishes them).

Against the real vLLM CPU server (the session's, and one started without the billing
flags), TokenStorm's fast upstream for a replica that serves another model or reports
another vLLM release, and a copy of the model directory whose chat template differs from
the one vLLM loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokengate import config as tg_config
from tokengate.doctor import engine_records, host, upstream
from tokengate.doctor.check import Check, Status, summary
from tokengate.ledger.engine_record import parse_record
from tokenstorm.null_server import FastUpstream
from tokenstorm.process import Service, free_port, tcp_ready

from tests.cli_calls import tokengate
from tests.conftest import KV_EVENTS, MODEL, PORT_OFFSET, TEST_DIR, VLLM_PORT
from tests.fixtures_ledger import wait_until
from tests.fixtures_vllm import BILLING_FLAGS, QUEUE_ENGINE, VllmServer

CHECKS = ["health", "model", "version", "prompt_tokens_details", "usage", "tool_parser",
          "engine_records", *(f"count {p[0]}" for p in upstream.PROBES)]
# routing.policy prefix (the test configuration's): every upstream, and one of kv_events
PREFIX_CHECKS = ["prefix_cache", "kv_events"]
VLLM = f"127.0.0.1:{VLLM_PORT}"
# where the session's vLLM and its queue server (tests/fixtures_vllm.py) write engine
# records
SESSION_ENGINE = TEST_DIR / "usage" / "engine.jsonl"
BARE_ENGINE = QUEUE_ENGINE
PLUGIN_MISSING = (
    "after 5 s: is the tokengate vLLM plugin installed in this vLLM's environment (pip "
    "install --no-deps ./vllm_patches; vLLM then logs 'engine usage records: engine 0 "
    "writes to ...') and is its TOKENGATE_ENGINE_USAGE_FILE one of "
    "ledger.engine_usage_files?")


def _config(base: Path, out: Path, upstreams: list[str],
            edit: Callable[[dict[str, Any]], None] | None = None,
            engine_files: Sequence[Path] = (SESSION_ENGINE, BARE_ENGINE),
            prefix: bool = False) -> Path:
    """``base`` with these upstreams; ``prefix``: its routing (by the prefix cache, the
    session's vLLM publishing KV events), else the default (no prefix checks)."""
    raw = yaml.safe_load(base.read_text())
    raw["models"][MODEL]["upstreams"] = upstreams
    raw["models"][MODEL]["embedded"] = False
    if not prefix:
        raw["models"][MODEL].pop("routing", None)
    raw.setdefault("ledger", {})["engine_usage_files"] = [str(f) for f in engine_files]
    if edit is not None:
        edit(raw)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def _doctor(config: Path, *args: str) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of ``tokengate doctor --config config``, run
    in this process (tests/cli_calls.py): a doctor process took ~2.3 CPU-s, most of it
    imports and parsing the model's tokenizer.json, which later calls reuse (the
    tokenizer's parse cache)."""
    r = tokengate("doctor", "--config", config, *args)
    return r.returncode, r.stdout.splitlines(), r.stderr


def _lines_of(lines: list[str], upstream: str) -> dict[str, str]:
    """check name -> its line, for the lines of one upstream."""
    out = {}
    for line in lines:
        status, (model, where, rest) = line[:4].strip(), line[5:].split(" ", 2)
        if where == upstream:
            assert model == MODEL
            out[rest.partition(":")[0]] = f"{status} {rest}"
    return out


def _doctor_fails(cfg: Path, upstream: str) -> tuple[dict[str, str], str]:
    """The doctor on ``cfg``, which must exit 1: (``_lines_of`` the upstream, stderr)."""
    status, lines, err = _doctor(cfg)
    assert status == 1
    return _lines_of(lines, upstream), err


def _failing(got: dict[str, str]) -> set[str]:
    """The checks of ``_lines_of`` whose line is not OK."""
    return {k for k, v in got.items() if not v.startswith("OK ")}


@pytest.fixture
def fast(replicas: Callable[..., FastUpstream],
         cfg: tg_config.Config) -> Callable[..., FastUpstream]:
    """Factory of fast upstreams (``UpstreamOptions`` keywords; by default the context
    the configuration gives the model), stopped at the end."""
    return lambda **opts: replicas(**{"max_model_len": cfg.models[MODEL].max_model_len,
                                      **opts})


@pytest.mark.unit
def test_versions_are_verified_by_major_and_minor() -> None:
    verified = ((0, 32),)
    assert [upstream.version_verified(v, verified) for v in
            ("0.32.0", "0.32.3+cpu", "0.32.1rc2", "0.33.0", "0.3.2", "0.320.1", "dev")] == \
        [True, True, True, False, False, False, False]


def test_doctor_passes_against_the_embedded_vllm(config_path: Path, vllm_url: str,
                                                private_redis: Callable[..., Any]) -> None:
    redis = private_redis(persist=True)  # what an operator's Redis is: append-only

    def durable(raw: dict[str, Any]) -> None:
        raw["redis"]["url"] = redis.url
    cfg = _config(config_path, TEST_DIR / "doctor" / "embedded.yaml", [VLLM], durable,
                  prefix=True)
    before = SESSION_ENGINE.stat().st_size if SESSION_ENGINE.exists() else 0
    status, lines, err = _doctor(cfg)
    assert status == 0, "\n".join(lines) + err
    got = _lines_of(lines, VLLM)
    assert list(got) == CHECKS + PREFIX_CHECKS
    assert all(line.startswith("OK ") for line in got.values()), lines
    assert got["model"] == "OK model: serves tiny-qwen3 (max_model_len 8192)"
    # the plugin (installed in the test venv) wrote the probe's record where the
    # ledger reads
    assert re.fullmatch(r"OK engine_records: the tokengate vLLM plugin recorded the probe "
                        rf"\(chatcmpl-tokengate-doctor-[0-9a-f]{{32}}\) in {SESSION_ENGINE}",
                        got["engine_records"]), got["engine_records"]
    assert got["version"] == "OK version: vLLM 0.32.0 (the counter mirrors 0.32.x)"
    assert got["usage"] == "OK usage: usage.prompt_tokens 10 = counter 10"
    assert got["count chat_tools"] == "OK count chat_tools: 191 tokens, vLLM /tokenize agrees"
    assert got["prefix_cache"] == ("OK prefix_cache: prefix caching on, blocks of 128 tokens, "
                                   "sha256 hashes, as models.tiny-qwen3.routing says")
    assert got["kv_events"] == (f"OK kv_events: tcp://{KV_EVENTS} published the probe's 2 "
                                "blocks with the counter's hashes")
    assert lines[-1] == (f"OK   redis 127.0.0.1:{redis.port} redis_persistence: appendonly "
                         "yes: the bill, budgets and checkpoints survive a restart")
    assert err.strip() == f"tokengate doctor: 1 upstream(s): {len(CHECKS) + 2} OK, " \
                          "0 warning(s), 0 failed, 0 skipped; host: redis_persistence OK"

    # the three requests that generate (the plain chat, the one with tools, the KV-event
    # probe) carry the doctor's id: the ledger counts their records as probes, not as
    # requests around the edge
    def probes() -> list[str]:
        with SESSION_ENGINE.open("rb") as f:
            f.seek(before)
            lines = f.read().splitlines()
        return [r.request_id for r in map(parse_record, lines) if r.doctor_probe]

    wait_until(lambda: len(probes()) == 3, 30, what="the doctor's three engine records")


def test_a_redis_that_keeps_nothing_across_a_restart_fails_the_doctor(
        config_path: Path, redis_url: str, fast: Callable[..., FastUpstream],
        private_redis: Callable[..., Any]) -> None:
    # the session's Redis keeps nothing (appendonly no, save ''), as the deploy section
    # left an operator's: its restart lost the bill and re-admitted a key at its budget
    replica = fast()

    def on(url: str) -> Callable[[dict[str, Any]], None]:
        def edit(raw: dict[str, Any]) -> None:
            raw["redis"]["url"] = url
        return edit
    cfg = _config(config_path, TEST_DIR / "doctor" / "volatile.yaml",
                  [f"127.0.0.1:{replica.port}"], on(redis_url))
    status, lines, err = _doctor(cfg, "--allow-unverified-vllm", "--engine-wait-s", "0.2")
    assert status == 1
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    assert lines[-1] == (
        f"FAIL redis 127.0.0.1:{port} redis_persistence: no persistence (appendonly no, "
        "save ''): a restart loses the bill, the budgets' spend and the ledger's "
        "checkpoints; set appendonly yes and appendfsync everysec in redis.conf "
        "(docs/operators/redis-durability.md)")
    assert err.strip().endswith("; host: redis_persistence FAIL")
    dead = private_redis()
    dead.stop()
    status, lines, err = _doctor(_config(config_path, TEST_DIR / "doctor" / "no-redis.yaml",
                                         [f"127.0.0.1:{replica.port}"], on(dead.url)),
                                 "--allow-unverified-vllm", "--engine-wait-s", "0.2")
    assert status == 1
    assert lines[-1].startswith(f"FAIL redis 127.0.0.1:{dead.port} redis_persistence: "
                                "Redis does not answer: ")


def test_the_doctor_fails_a_config_the_units_own_user_cannot_read(
        config_path: Path, redis_url: str, fast: Callable[..., FastUpstream]) -> None:
    # the upgrade of 0.1.0: keys create had left tokengate.yaml root:root 0600, every
    # sidecar unit exited with Permission denied, and the doctor said OK
    from tests.deploy.test_install import install, test_config

    replica = fast()
    base = TEST_DIR / "doctor" / "installed"   # a folder every user may enter (not /tmp's)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    raw = yaml.safe_load(test_config(config_path, redis_url, base / "c.yaml").read_text())
    raw["models"][MODEL].update(upstreams=[f"127.0.0.1:{replica.port}"], embedded=False)
    raw["models"][MODEL].pop("routing", None)
    (base / "c.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    prefix = base / "root"
    assert install(prefix, "--config", base / "c.yaml").returncode == 0
    units = prefix / "etc/systemd/system"
    for name in host.SIDECAR_UNITS:  # a user this machine has, in the units' group
        unit = units / name
        unit.write_text(unit.read_text().replace("User=tokengate", "User=nobody"))
    config = prefix / "etc/tokengate/tokengate.yaml"

    def unit_lines() -> list[str]:
        _status, lines, _err = _doctor(config, "--allow-unverified-vllm",
                                       "--engine-wait-s", "0.2")
        return [line for line in lines if line[5:].startswith("unit ")]

    assert unit_lines() == [
        ("OK   unit tokengate-counter.service readable: user nobody (group www-data) reads "
        "the configuration and what it follows"),
        ("OK   unit tokengate-ledger.service readable: user nobody (group www-data) reads "
        "the configuration and what it follows"),
        ("OK   unit tokengate-limits.service readable: user nobody (group www-data) reads "
        "the configuration"),
        ("OK   unit tokengate-console.service readable: user nobody (group www-data) reads "
        "the configuration and what it follows")]
    os.chown(config, 0, 0)
    config.chmod(0o600)
    assert unit_lines() == [
        f"FAIL unit {name} readable: user nobody (group www-data) cannot read {config} (600 "
        "root:root): the unit exits at start; run `tokengate install` again (it sets the "
        "owners and modes back)" for name in host.SIDECAR_UNITS]


def test_a_replica_serving_another_model_fails_loudly(
        config_path: Path, vllm_url: str, fast: Callable[..., FastUpstream]) -> None:
    other = fast(model="other-model")
    replica = f"127.0.0.1:{other.port}"
    cfg = _config(config_path, TEST_DIR / "doctor" / "other-model.yaml", [VLLM, replica])
    status, lines, err = _doctor(cfg)
    assert status == 1
    assert all(line.startswith("OK ") for line in _lines_of(lines, VLLM).values())
    got = _lines_of(lines, replica)
    assert list(got) == CHECKS
    assert got["health"].startswith("OK ")
    assert got["model"] == ("FAIL model: serves other-model, not tiny-qwen3: the edge's "
                            "requests would get 404 (vLLM's --served-model-name)")
    assert got["usage"] == ("FAIL usage: a chat request got HTTP 404: The model `tiny-qwen3` "
                            "does not exist. Valid aliases: other-model.")
    assert got["engine_records"] == \
        "SKIP engine_records: not checked: the chat request failed (above)"
    assert "14 OK, 0 warning(s), 9 failed, 1 skipped" in err


def test_an_unverified_vllm_release_fails_unless_allowed(
        config_path: Path, vllm_url: str, fast: Callable[..., FastUpstream]) -> None:
    newer = fast(model=MODEL, vllm_version="0.33.1")
    replica = f"127.0.0.1:{newer.port}"
    cfg = _config(config_path, TEST_DIR / "doctor" / "newer.yaml", [replica])
    status, lines, _ = _doctor(cfg)
    assert status == 1
    assert _lines_of(lines, replica)["version"] == (
        "FAIL version: vLLM 0.33.1 is not a release the counter was verified against "
        "(0.32.x): its prompt preprocessing may count differently; --allow-unverified-vllm "
        "accepts it")
    _, lines, _ = _doctor(cfg, "--allow-unverified-vllm")
    assert _lines_of(lines, replica)["version"] == (
        "WARN version: vLLM 0.33.1 is not a release the counter was verified against "
        "(0.32.x); accepted (--allow-unverified-vllm): the count checks below are the "
        "evidence")
    # a real vLLM whose release is not in the verified list: the override lets the
    # run pass on the evidence of the count checks
    cfg_real = tg_config.load(config_path)
    seen: list[str] = []
    checks = upstream.run(cfg_real, verified=((0, 31),), out=seen.append)
    assert [(c.name, c.status) for c in checks if c.status != "OK"] == [("version", "FAIL")]
    checks = upstream.run(cfg_real, verified=((0, 31),), allow_unverified=True,
                        out=seen.append)
    assert [(c.name, c.status) for c in checks if c.status != "OK"] == [("version", "WARN")]
    # upstream.run() as the counter's --check-upstreams calls it: no engine_records (and
    # the prefix checks of the test configuration)
    assert summary(checks).endswith(f"{len(CHECKS)} OK, 1 warning(s), 0 failed, "
                                           "0 skipped")


def test_counts_that_differ_from_vllms_tokenize_fail(config_path: Path, vllm_url: str) -> None:
    # the counter reads a copy of the model whose tool preamble has three more words
    # than the template vLLM loads: bodies with tools count differently, others agree
    src = tg_config.load(config_path).models[MODEL].dir
    copy = TEST_DIR / "doctor" / "other-template"
    copy.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(src / name, copy / name)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    preamble = "You may call one or more functions"
    assert preamble in tc["chat_template"]
    tc["chat_template"] = tc["chat_template"].replace(preamble, preamble + " or none at all")
    (copy / "tokenizer_config.json").write_text(json.dumps(tc))

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["dir"] = str(copy)

    cfg = _config(config_path, TEST_DIR / "doctor" / "other-template.yaml", [VLLM], edit)
    got, err = _doctor_fails(cfg, VLLM)
    assert _failing(got) == {"count chat_tools", "count chat_multi_turn"}
    assert got["count chat_tools"] == (
        "FAIL count chat_tools: vLLM /tokenize 191, counter 195 (-4): is "
        "models.tiny-qwen3.dir the directory this vLLM loads (tokenizer, chat template)?")
    assert "2 failed" in err


def test_an_unreachable_upstream_fails_and_skips_the_rest(config_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    cfg = _config(config_path, TEST_DIR / "doctor" / "dead.yaml", [dead])
    status, lines, err = _doctor(cfg, "--timeout-s", "2")
    assert status == 1
    got = _lines_of(lines, dead)
    assert list(got) == CHECKS
    assert got["health"].startswith("FAIL health: unreachable (")
    assert {v for k, v in got.items() if k != "health"} == \
        {f"SKIP {k}: not checked: the upstream is not healthy" for k in CHECKS[1:]}
    assert "0 OK, 0 warning(s), 1 failed, 11 skipped" in err


def test_a_replica_without_the_plugin_fails_the_engine_records_check(
        config_path: Path, fast: Callable[..., FastUpstream]) -> None:
    # the fast upstream answers like vLLM but has no tokengate plugin: whether the
    # ledger's engine file is there (another replica's) or not, the probe's record never
    # comes
    plain = fast(model=MODEL)
    replica = f"127.0.0.1:{plain.port}"
    present = TEST_DIR / "doctor" / "engine-other.jsonl"
    present.parent.mkdir(parents=True, exist_ok=True)
    present.write_text("")
    missing = TEST_DIR / "doctor" / "engine-never-written.jsonl"
    missing.unlink(missing_ok=True)
    for files in ([present], [missing]):
        cfg = _config(config_path, TEST_DIR / "doctor" / "no-plugin.yaml", [replica],
                      engine_files=files)
        # the record never comes: wait 1 s for it, not the default 5
        status, lines, _ = _doctor(cfg, "--engine-wait-s", "1")
        got = _lines_of(lines, replica)
        assert status == 1
        assert re.fullmatch(r"FAIL engine_records: no engine record of the probe "
                            r"\(chatcmpl-tokengate-doctor-[0-9a-f]{32}\) in "
                            + re.escape(f"{files[0]} "
                                        + PLUGIN_MISSING.replace("after 5 s", "after 1 s")),
                            got["engine_records"]), got["engine_records"]
        # what it does serve like vLLM passes (its /tokenize counts are not vLLM's)
        assert all(got[k].startswith("OK ") for k in CHECKS[:CHECKS.index("engine_records")])


def test_a_ledger_that_reads_no_engine_records_fails_the_engine_records_check(
        config_path: Path, fast: Callable[..., FastUpstream]) -> None:
    plain = fast(model=MODEL)
    replica = f"127.0.0.1:{plain.port}"
    cfg = _config(config_path, TEST_DIR / "doctor" / "no-engine-files.yaml", [replica],
                  engine_files=[])
    status, lines, _ = _doctor(cfg)
    assert status == 1
    assert _lines_of(lines, replica)["engine_records"] == (
        "FAIL engine_records: ledger.engine_usage_files is empty: the ledger reads no engine "
        "records, so client disconnects and n > 1 are billed from the edge's numbers; list "
        "each replica's TOKENGATE_ENGINE_USAGE_FILE there (tokengate-vllm@PORT writes "
        "/var/lib/tokengate/engine/PORT.jsonl)")


def test_with_no_engine_files_configured_the_doctor_asks_the_running_ledger(
        config_path: Path, redis_url: str) -> None:
    # make run gives its ledger the embedded vLLM's file on the command line
    from tokengate_dev import devstack

    listen = f"127.0.0.1:{free_port()}"
    engine = TEST_DIR / "doctor" / "followed-engine.jsonl"
    cfg_path = _config(config_path, TEST_DIR / "doctor" / "followed.yaml",
                       [f"127.0.0.1:{free_port()}"], engine_files=[],
                       edit=lambda raw: raw.update(metrics={"ledger_listen": listen}))
    ledger = devstack.ledger_service(cfg_path, TEST_DIR / "doctor" / "followed-usage.jsonl",
                                     redis_url, ledger_id="doctor-followed",
                                     name=f"test-ledger-doctor{PORT_OFFSET or ''}",
                                     engine_files=[engine], metrics_listen=listen)
    ledger.log_dir = TEST_DIR / "log"
    ledger.start()
    try:
        assert engine_records.followed_by_ledger(tg_config.load(cfg_path)) == [engine]
    finally:
        ledger.stop()
    assert engine_records.followed_by_ledger(tg_config.load(cfg_path), timeout_s=1) == []


@pytest.mark.unit
def test_a_remote_replicas_engine_records_not_on_this_host_are_a_warning(
        tmp_path: Path) -> None:
    # a replica on another host writes its records there (read by a `tokengate-ledger
    # --engine-only` of that host): here the doctor can only say it did not look
    files = [tmp_path / "8100.jsonl"]
    seen: list[Check] = []

    def check(what: str, status: Status, detail: str) -> Check:
        seen.append(Check(MODEL, "10.0.0.7:8100", what, status, detail))
        return seen[-1]

    c = engine_records.check_records(check, "10.0.0.7:8100", files,
                                     engine_records.EngineMarks.take(files), "chatcmpl-x",
                                     True, 0.0)
    assert (c.status, c.detail) == ("WARN", (
        f"not checked here: none of ledger.engine_usage_files ({files[0]}) exists on this "
        "host; run tokengate doctor on the vLLM host, where its records are written"))


def test_a_config_that_cannot_be_read_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "tokengate.yaml"
    bad.write_text("models: {}\n")
    status, lines, err = _doctor(bad)
    assert (status, lines) == (2, [])
    assert err.startswith("models: ")


@pytest.fixture
def bare_vllm(queue_vllm: VllmServer) -> str:
    """host:port of a second vLLM CPU server on the same model, started without the flags
    billing relies on (--enable-prompt-tokens-details, the tool parser): the session's
    queue server (tests/fixtures_vllm.py)."""
    assert not set(BILLING_FLAGS) & set(queue_vllm.argv)
    return queue_vllm.address


def test_a_vllm_without_the_billing_flags_fails(config_path: Path, bare_vllm: str) -> None:
    # the server with the flags passes every check: test_doctor_passes_against_the_embedded_vllm
    # (this test asks for the queue server alone, which boots beside the default one)
    cfg = _config(config_path, TEST_DIR / "doctor" / "bare.yaml", [bare_vllm],
                  engine_files=(BARE_ENGINE,))
    got, err = _doctor_fails(cfg, bare_vllm)
    assert _failing(got) == {"prompt_tokens_details", "tool_parser"}
    assert got["prompt_tokens_details"] == (
        "FAIL prompt_tokens_details: usage.prompt_tokens_details is missing: start vLLM "
        "with --enable-prompt-tokens-details (without it prefix-cache hits are billed as "
        "uncached input)")
    assert got["tool_parser"].startswith("FAIL tool_parser: a request with tools got HTTP 400: ")
    assert got["tool_parser"].endswith(": start vLLM with --enable-auto-tool-choice "
                                       "--tool-call-parser <the model's parser> (hermes for "
                                       "Qwen3)")
    assert "2 failed" in err


def _counter(config: Path, port: int, *args: str) -> Service:
    argv = [sys.executable, "-m", "tokengate.counter.server", "--config", str(config),
            "--port", str(port), "--workers", "1", *args]
    return Service(f"test-counter-check{PORT_OFFSET or ''}", argv,
                   tcp_ready("127.0.0.1", port), start_timeout_s=120.0,
                   log_dir=TEST_DIR / "doctor")


def test_the_counter_refuses_to_start_on_a_failed_upstream_check(
        config_path: Path, fast: Callable[..., FastUpstream]) -> None:
    other = fast(model="other-model")
    cfg = _config(config_path, TEST_DIR / "doctor" / "counter-other.yaml",
                  [f"127.0.0.1:{other.port}"])
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "tokengate.counter.server", "--config",
                        str(cfg), "--port", str(port), "--workers", "1", "--check-upstreams"],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 1
    assert (f"counter: upstream check: FAIL tiny-qwen3 127.0.0.1:{other.port} model: serves "
            "other-model, not tiny-qwen3") in r.stdout
    assert "listening" not in r.stdout
    assert r.stderr.strip().endswith("an upstream check failed (lines above); not serving")


def test_the_counter_serves_after_a_passing_upstream_check(config_path: Path,
                                                           vllm_url: str) -> None:
    svc = _counter(config_path, free_port(), "--check-upstreams")
    svc.log_path.unlink(missing_ok=True)
    svc.start()
    try:
        log = svc.log_tail(200)
        assert f"counter: upstream check: OK   tiny-qwen3 {VLLM} count chat_cjk" in log
        # the counter's check runs every check but engine_records (the ledger's concern)
        # (and the prefix checks: the test configuration routes by the prefix cache)
        assert (f"counter: upstream check: 1 upstream(s): {len(CHECKS) + 1} OK, 0 warning(s), "
                "0 failed, 0 skipped") in log
    finally:
        svc.stop()


def test_replica_settings_that_differ_from_the_routing_fail(config_path: Path,
                                                            vllm_url: str) -> None:
    """The block size and hash algorithm vLLM reports on /metrics, and the hashes it
    publishes (the only evidence of its PYTHONHASHSEED), against models.<name>.routing;
    a kv_events entry for a host that is not an upstream is only a warning."""
    stray = "127.0.0.1:9"

    def seed(raw: dict[str, Any]) -> None:
        routing = raw["models"][MODEL]["routing"]
        routing["hash_seed"] = 7
        routing["kv_events"][stray] = "tcp://127.0.0.1:9"

    cfg = _config(config_path, TEST_DIR / "doctor" / "seed.yaml", [VLLM], seed, prefix=True)
    status, lines, err = _doctor(cfg)
    assert status == 1
    got = _lines_of(lines, VLLM)
    assert _failing(got) == {"kv_events"}
    assert got["kv_events"] == (
        f"FAIL kv_events: tcp://{KV_EVENTS} published the probe's blocks with other hashes "
        "than the counter's: is models.tiny-qwen3.routing.hash_seed the replica's "
        "PYTHONHASHSEED (null: none set)?")
    assert _lines_of(lines, stray) == {"kv_events": (
        f"WARN kv_events: models.tiny-qwen3.routing.kv_events names {stray}, which is not "
        "one of its upstreams: not followed")}
    assert "1 warning(s), 1 failed" in err

    dead = f"127.0.0.1:{free_port()}"

    def sizes(raw: dict[str, Any]) -> None:
        routing = raw["models"][MODEL]["routing"]
        routing.update(block_size=16, hash_algo="sha256_cbor")
        routing["kv_events"] = {VLLM: f"tcp://{dead}"}

    cfg = _config(config_path, TEST_DIR / "doctor" / "sizes.yaml", [VLLM], sizes, prefix=True)
    got, err = _doctor_fails(cfg, VLLM)
    assert _failing(got) == set(PREFIX_CHECKS)
    assert got["prefix_cache"] == (
        "FAIL prefix_cache: its --block-size is 128, models.tiny-qwen3.routing.block_size is "
        "16; its --prefix-caching-hash-algo is sha256, models.tiny-qwen3.routing.hash_algo "
        "is sha256_cbor: the counter's block hashes would never match the replica's")
    assert got["kv_events"] == (
        f"FAIL kv_events: nothing listens on tcp://{dead} after 10 s: start vLLM with "
        "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
        f"\"endpoint\": \"tcp://*:{dead.rpartition(':')[2]}\"}}'")
