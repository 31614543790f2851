"""``tokengate keys`` against a running edge: real nginx, the real counter, TokenStorm's
fast upstream as the model server, the official openai client.
(Over 600 lines: the keys command's verbs against one running edge fixture and one
repository-copy helper.)

A key the CLI creates is admitted as soon as the command returns and a revoked one is
refused as soon as it returns (the command reloads the edge and waits for its new
workers); a key limited to one model cannot use another and sees only its own in
/v1/models; an edit that the schema refuses leaves the file as it was.
"""

from __future__ import annotations

import fcntl
import grp
import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import yaml
from tokengate import config as tg_config
from tokengate import keys, redis_keys
from tokengate.config.keys import timestamp
from tokengate.tools import compile_config
from tokenstorm.process import Service, free_port, tcp_ready

from tests import units
from tests.cli_calls import tokengate
from tests.conftest import MODEL, NO_REDIS, REPO_CONFIG
from tests.deploy.test_debian_dropin import HostFiles, debian_layout
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, PORT_OFFSET, Edge
from tests.fixtures_ledger import wait_until

OTHER = "other-qwen3"  # a second served model (the same files; never reached here)


def _with_fast(upstream: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [upstream]
        raw["models"][MODEL]["embedded"] = False
        raw["models"][OTHER] = {**raw["models"][MODEL], "upstreams": [upstream]}
    return edit


def created(name: str, *args: str | Path) -> str:
    """``tokengate keys create NAME ARGS``, which must succeed: the new key it printed."""
    made = tokengate("keys", "create", name, *args)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def _repo_copy(tmp_path: Path) -> tuple[Path, str]:
    """The repository's tokengate.yaml (comments and all) with global limits on, in
    ``tmp_path``: (its path, its text)."""
    text = REPO_CONFIG.read_text().replace(
        "dir: var/models/", f"dir: {REPO_CONFIG.parent / 'var' / 'models'}/").replace(
        "url: redis://127.0.0.1:6380/0", f"url: {NO_REDIS}").replace(
        "enabled: false                  # true: the edge",
        "enabled: true                   # true: the edge")
    path = tmp_path / "tokengate.yaml"
    path.write_text(text)
    return path, text


@pytest.fixture
def keys_edge(edge_variant_off_vllm: Callable[..., Edge],
              fast_upstream_url: str) -> tuple[Edge, Path, Path]:
    """An edge in front of the fast upstream: (edge, its tokengate.yaml, its folder)."""
    name = "keys"
    hostport = fast_upstream_url.removeprefix("http://").removesuffix("/v1")
    e = edge_variant_off_vllm(name, _with_fast(hostport))
    return e, EDGE_DIR / name / "tokengate.yaml", EDGE_DIR / f"test-nginx-{name}{PORT_OFFSET or ''}"


def _chat(client: openai.OpenAI, model: str = MODEL) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_a_created_key_works_at_once_and_a_revoked_one_is_refused_at_once(
        keys_edge: tuple[Edge, Path, Path]) -> None:
    edge, path, prefix = keys_edge
    key = created("cli-made", "--rpm", "100", "--tpm", "100000", "--config", path,
                  "--edge", prefix)
    assert key.startswith("tg-") and len(key) == 46
    raw = yaml.safe_load(path.read_text())
    assert key not in path.read_text()
    assert set(raw["keys"]["cli-made"]) == {"sha256", "rpm", "tpm"}
    client = openai.OpenAI(base_url=edge.base_url, api_key=key, max_retries=0)
    reply = _chat(client)
    assert reply.usage is not None and reply.usage.completion_tokens == 4

    gone = tokengate("keys", "revoke", "cli-made", "--config", path, "--edge", prefix)
    assert gone.returncode == 0, gone.stderr
    with pytest.raises(openai.AuthenticationError) as e:
        _chat(client)
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key"
    assert "cli-made" not in yaml.safe_load(path.read_text())["keys"]


def test_a_key_limited_to_one_model_sees_and_uses_only_it(
        keys_edge: tuple[Edge, Path, Path]) -> None:
    edge, path, prefix = keys_edge
    key = created("one-model", "--rpm", "100", "--tpm", "100000",
                  "--models", MODEL, "--config", path, "--edge", prefix)
    client = openai.OpenAI(base_url=edge.base_url, api_key=key,
                           max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert _chat(client).model == MODEL
    denied = ("The model `other-qwen3` does not exist or you do not have access to it.")
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, OTHER)
    assert e.value.body == {"message": denied, "type": "invalid_request_error",
                            "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve(OTHER)
    assert e.value.body["message"] == denied
    # the same answer as a model that does not exist
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, "no-such-model")
    assert e.value.body["message"] == denied.replace(OTHER, "no-such-model")
    ev = edge.event(e.value.response.headers["x-request-id"])
    assert (ev["key_id"], ev["model"], ev["error"]) == ("one-model", None, "model_not_found")
    # every model again
    changed = tokengate("keys", "set", "one-model", "--models", "all", "--config", path,
                        "--edge", prefix)
    assert changed.returncode == 0, changed.stderr
    assert [m.id for m in client.models.list()] == sorted([MODEL, OTHER])


def test_keys_refuses_to_write_a_file_with_a_typo(keys_edge: tuple[Edge, Path, Path]) -> None:
    _, path, prefix = keys_edge
    text = path.read_text().replace("max_tokens_cap:", "max_token_cap:", 1)
    assert "max_token_cap:" in text
    path.write_text(text)
    made = tokengate("keys", "create", "typo", "--rpm", "1", "--tpm", "1", "--config", path,
                     "--edge", prefix)
    assert made.returncode == 1
    assert made.stdout == ""  # no key printed: none was stored
    assert made.stderr.splitlines() == [f"models.{MODEL}.max_token_cap: unknown key",
                                        f"{path}: not changed"]
    assert path.read_text() == text


def test_a_budget_without_global_limits_is_refused_and_nothing_is_written(
        keys_edge: tuple[Edge, Path, Path]) -> None:
    _, path, prefix = keys_edge
    text = path.read_text()
    made = tokengate("keys", "create", "no-redis", "--rpm", "5", "--tpm", "500",
                     "--budget", "day=1", "--config", path, "--edge", prefix)
    assert (made.returncode, made.stdout) == (1, "")
    assert made.stderr.splitlines() == [
        ("keys.no-redis.budgets: budgets need global_limits.enabled: true (their spend is "
         "kept in Redis by tokengate-limits, so it survives restarts and is shared by every "
         "edge)"), f"{path}: not changed"]
    assert path.read_text() == text


def test_a_key_id_with_a_space_is_refused(keys_edge: tuple[Edge, Path, Path]) -> None:
    _, path, prefix = keys_edge
    text = path.read_text()
    made = tokengate("keys", "create", "team a", "--rpm", "5", "--tpm", "500",
                     "--config", path, "--edge", prefix)
    assert (made.returncode, made.stdout) == (1, "")
    assert made.stderr.splitlines()[0] == (
        "keys.team a: a key id is 1-64 letters, digits, '.', '_', '-' or '@', starting "
        "with a letter or digit")
    assert path.read_text() == text


def test_keys_list_json_never_shows_a_key(tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    key = created("listed", "--rpm", "7", "--tpm", "700", "--models",
                  MODEL, "--budget", "day=2.5", "--budget", f"{MODEL}:month=1000t",
                  "--config", path, "--no-apply")
    listed = tokengate("keys", "list", "--json", "--config", path, "--redis-url",
                       "redis://127.0.0.1:1/0")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    entry = next(k for k in doc["keys"] if k["name"] == "listed")
    assert key not in listed.stdout
    assert {k: entry[k] for k in ("rpm", "tpm", "allowed_models", "models")} == \
        {"rpm": 7, "tpm": 700, "allowed_models": [MODEL], "models": {}}
    assert [(b["period"], b["model"], b["spend"], b["tokens"]) for b in entry["budgets"]] == \
        [("day", None, 2.5, None), ("month", MODEL, None, 1000)]


def test_a_reload_under_streaming_load_drops_nothing(
        edge_variant_off_vllm: Callable[..., Edge], slow_upstream_url: str) -> None:
    name = "keys-stream"
    hostport = slow_upstream_url.removeprefix("http://").removesuffix("/v1")
    edge = edge_variant_off_vllm(name, _with_fast(hostport))
    path = EDGE_DIR / name / "tokengate.yaml"
    prefix = EDGE_DIR / f"test-nginx-{name}{PORT_OFFSET or ''}"
    client = openai.OpenAI(base_url=edge.base_url, api_key=MAIN_KEY, max_retries=0)

    def stream() -> tuple[int, str | None, str | None]:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1500,
            stream=True, stream_options={"include_usage": True})
        finish, usage, rid = None, None, None
        for c in chunks:
            rid = rid or c.id
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
            if c.usage is not None:
                usage = c.usage.completion_tokens
        return usage or 0, finish, rid

    # 16 clients stream one request after another until both key changes are applied: a
    # reload always meets streams being answered, however long the commands take
    stop = threading.Event()

    def client_loop(_: int) -> list[tuple[int, str | None, str | None]]:
        done = [stream()]
        while not stop.is_set():
            done.append(stream())
        return done

    with ThreadPoolExecutor(16) as pool:
        running = [pool.submit(client_loop, i) for i in range(16)]
        time.sleep(0.3)  # under way: 1500 tokens at 2 ms each, >= 3 s a stream
        in_flight = []
        try:
            for i in range(2):
                created(f"during-{i}", "--rpm", "10", "--tpm",
                        "1000", "--config", path, "--edge", prefix)
                in_flight.append(sum(not f.done() for f in running))
        finally:
            stop.set()
        results = [r for f in running for r in f.result()]
    assert in_flight == [16, 16]  # the reloads happened while streams were being answered
    assert results == [(1500, "length", r[2]) for r in results]

    def mains() -> list[dict[str, Any]]:
        return [ev for ev in edge.events() if ev["key_id"] == "edge-main"]

    # each usage event is written in the log phase, after its stream's last byte
    wait_until(lambda: len(mains()) >= len(results), 10, what="a usage event per stream")
    assert all(ev["status"] == 200 and not ev["client_aborted"]
               and ev["completion_tokens"] == 1500 for ev in mains())
    assert len(mains()) == len(results)


def test_a_budget_below_a_ten_thousandth_is_written_as_typed(tmp_path: Path) -> None:
    """A float written by repr (5e-05) is a string to the configuration's YAML reader:
    the key was refused with "spend: input should be a valid number"."""
    path, _ = _repo_copy(tmp_path)
    created("tiny-budget", "--rpm", "5", "--tpm", "500",
            "--budget", "day=0.00005", "--config", path, "--no-apply")
    assert "spend: 0.00005\n" in path.read_text()
    listed = tokengate("keys", "list", "--json", "--config", path, "--redis-url",
                       "redis://127.0.0.1:1/0")
    entry = next(k for k in json.loads(listed.stdout)["keys"] if k["name"] == "tiny-budget")
    assert [b["spend"] for b in entry["budgets"]] == [0.00005]


REFUSED = [
    (["create", "x", "--rpm", "6", "--tpm", "9", "--budget", "day=99999999999999999999999"],
     ("keys.x.budgets.0.spend: input should be less than or equal to 1000000000, got "
      "99999999999999999999999")),
    (["create", "x", "--rpm", "99999999999999999999", "--tpm", "9"],
     ("keys.x.rpm: input should be less than or equal to 1000000000000, got "
      "99999999999999999999")),
    (["create", "x", "--rpm", "6", "--tpm", "9", "--budget", "day=0.0000000001"],
     "keys.x.budgets.0.spend: input should be greater than or equal to 0.000001, got 1e-10"),
    (["create", "x", "--rpm", "6", "--tpm", "9", "--budget", "day=5", "--budget", "day=6"],
     "tokengate keys: --budget: two day spend limits for the whole key (every model)"),
    (["create", "x", "--rpm", "6", "--tpm", "9", "--models", "other-qwen3", "--budget",
      f"{MODEL}:day=5"], "keys.x.budgets.0.model: not one of the key's allowed_models"),
    (["set", "demo"], ("tokengate keys: nothing to change: give --rpm, --tpm, --models, "
                       "--budget, --priority, --no-budgets, --max-tokens-cap, "
                       "--cached-tokens-weight, --expires-at, --owner or --description")),
    (["set", "demo", "--cached-tokens-weight", "2"],
     "keys.demo.cached_tokens_weight: input should be less than or equal to 1, got 2.0"),
    (["set", "demo", "--models", ","], ("tokengate keys: --models: name at least one "
                                        "model, or all")),
]


@pytest.mark.parametrize("args,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_keys_refuses_what_the_edge_cannot_enforce_and_writes_nothing(
        tmp_path: Path, args: list[str], message: str) -> None:
    path, text = _repo_copy(tmp_path)
    if "other-qwen3" in args:
        text = text.replace("\ncurrency:", "\n  other-qwen3:\n    dir: "
                            f"{REPO_CONFIG.parent / 'var' / 'models' / 'tiny-qwen3'}\n"
                            "    max_model_len: 8192\n    upstreams: [127.0.0.1:8000]\n"
                            "\ncurrency:", 1)
        path.write_text(text)
    out = tokengate("keys", *args, "--config", path, "--no-apply")
    assert out.returncode in (1, 2) and out.stdout == ""
    assert out.stderr.splitlines()[0] == message
    assert path.read_text() == text


def test_a_negative_budget_is_refused_as_negative(tmp_path: Path) -> None:
    path, text = _repo_copy(tmp_path)
    out = tokengate("keys", "create", "x", "--rpm", "6", "--tpm", "9", "--budget", "day=-1",
                    "--config", path, "--no-apply")
    assert out.returncode == 2 and out.stderr.splitlines()[-1].endswith(
        "argument --budget: a budget is not negative: 'day=-1'"), out.stderr
    assert path.read_text() == text


BAD_REDIS = [["keys", "set", "demo", "--rpm", "4"], ["keys", "list"], ["usage"],
             ["console", "role", "admin", "read-only"]]


@pytest.mark.parametrize("args", BAD_REDIS, ids=[" ".join(a) for a in BAD_REDIS])
def test_a_bad_redis_url_is_a_usage_error_before_anything_changes(
        tmp_path: Path, args: list[str]) -> None:
    """--redis-url is checked as redis.url is, when the command line is read: `keys set`
    used to apply its change, then fail on the URL with a traceback."""
    path, text = _repo_copy(tmp_path)
    out = tokengate(*args, "--config", path, "--redis-url", "notaurl")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines()[-1].endswith(
        "argument --redis-url: expected a redis://, rediss:// or unix:// URL, "
        "got 'notaurl'"), out.stderr
    assert path.read_text() == text


def test_keys_on_a_file_that_is_not_yaml_says_so_in_one_line(tmp_path: Path) -> None:
    path, text = _repo_copy(tmp_path)
    path.write_text(text + "keys:\n  bad: [\n")
    out = tokengate("keys", "create", "x", "--rpm", "1", "--tpm", "1", "--config", path,
                    "--no-apply")
    assert out.returncode == 1
    first, last = out.stderr.splitlines()
    assert first.startswith(f"{path}: not YAML: while parsing a flow node")
    assert last == f"{path}: not changed"


def test_keys_create_and_revoke_keep_the_next_sections_heading_in_place(
        tmp_path: Path) -> None:
    """ruamel.yaml keeps the comment lines after the last key (the heading of the next
    section) on that key: a key appended after it would have been written below them."""
    path, text = _repo_copy(tmp_path)
    heading = "\n# Redis: the usage ledger's counters and the global (cross-edge) limits.\nredis:\n"
    assert heading in text
    key = created("last", "--rpm", "5", "--tpm", "500", "--budget", "day=1", "--budget",
                  f"{MODEL}:month=2.50", "--config", path, "--no-apply")
    edited = path.read_text()
    assert heading in edited
    keys_block = edited[edited.index("\nkeys:\n"):edited.index(heading)]
    assert keys_block.rstrip().endswith(
        f"  last:\n    sha256: {hashlib.sha256(key.encode()).hexdigest()}\n"
        "    rpm: 5\n    tpm: 500\n    budgets:\n      - period: day\n        spend: 1\n"
        f"      - period: month\n        model: {MODEL}\n        spend: 2.50")
    for change in (["--budget", "day=6"], ["--no-budgets", "--models", MODEL],
                   ["--budget", f"{MODEL}:month=200t"]):
        changed = tokengate("keys", "set", "last", *change, "--config", path, "--no-apply")
        assert changed.returncode == 0, changed.stderr
        assert heading in path.read_text(), change
    revoked = tokengate("keys", "revoke", "last", "--config", path, "--no-apply")
    assert revoked.returncode == 0, revoked.stderr
    assert path.read_text() == text


def test_a_spend_and_a_token_spec_of_one_period_make_one_budget(tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    created("both", "--rpm", "5", "--tpm", "500", "--budget",
            "day=1", "--budget", "day=2000t", "--config", path, "--no-apply")
    changed = tokengate("keys", "set", "both", "--budget", "day=3", "--config", path,
                        "--no-apply")  # sets the spend limit; the token quota stays
    assert changed.returncode == 0, changed.stderr
    # --config before the verb reads the same file as after it
    listed = json.loads(tokengate("keys", "--config", path, "list", "--json",
                                  "--redis-url", "redis://127.0.0.1:1/0").stdout)
    entry = next(k for k in listed["keys"] if k["name"] == "both")
    assert [(b["period"], b["model"], b["spend"], b["tokens"]) for b in entry["budgets"]] == \
        [("day", None, 3, 2000)]


def test_a_keys_cap_and_cached_weight_are_written_and_dropped_back_to_the_models(
        tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    created("agent", "--rpm", "5", "--tpm", "500",
            "--max-tokens-cap", "2048", "--cached-tokens-weight", "0.5",
            "--config", path, "--no-apply")
    key = yaml.safe_load(path.read_text())["keys"]["agent"]
    assert (key["max_tokens_cap"], key["cached_tokens_weight"]) == (2048, 0.5)
    changed = tokengate("keys", "set", "agent", "--max-tokens-cap", "model", "--config", path,
                        "--no-apply")
    assert changed.returncode == 0, changed.stderr
    key = yaml.safe_load(path.read_text())["keys"]["agent"]
    assert "max_tokens_cap" not in key and key["cached_tokens_weight"] == 0.5


def test_a_session_budget_is_set_kind_by_kind_and_dropped(tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    created("agent", "--rpm", "5", "--tpm", "500",
            "--session-budget", "200000t", "--config", path, "--no-apply")
    changed = tokengate("keys", "set", "agent", "--session-budget", "2.5", "--config", path,
                        "--no-apply")  # adds the spend limit; the token limit stays
    assert changed.returncode == 0, changed.stderr
    budget = tg_config.load(path).keys["agent"].session_budget
    assert budget is not None and (budget.tokens, budget.spend) == (200_000, 2.5)
    dropped = tokengate("keys", "set", "agent", "--no-session-budget", "--config", path,
                        "--no-apply")
    assert dropped.returncode == 0, dropped.stderr
    assert tg_config.load(path).keys["agent"].session_budget is None


@pytest.mark.parametrize("name", ["yes", "no", "on", "off", "1_000", "null"])
def test_a_key_named_like_a_yaml_1_1_boolean_or_number_survives_the_round_trip(
        tmp_path: Path, name: str) -> None:
    """PyYAML (the configuration's loader) reads YAML 1.1: a plain key `yes:` was the
    boolean True, and the key was refused ("input should be a valid string, got True")."""
    path, _ = _repo_copy(tmp_path)
    key = created(name, "--rpm", "5", "--tpm", "500", "--config", path, "--no-apply")
    assert f"\n  '{name}':\n    sha256: {hashlib.sha256(key.encode()).hexdigest()}" \
        in path.read_text()
    assert name in yaml.safe_load(path.read_text())["keys"]  # any YAML 1.1 reader agrees
    # the next edit reads it back and writes it again
    created("after", "--rpm", "5", "--tpm", "500", "--config", path, "--no-apply")
    listed = json.loads(tokengate("keys", "list", "--json", "--config", path, "--redis-url",
                                  "redis://127.0.0.1:1/0").stdout)
    assert [k["name"] for k in listed["keys"]] == ["demo", name, "after"]
    gone = tokengate("keys", "revoke", name, "--config", path, "--no-apply")
    assert gone.returncode == 0, gone.stderr
    assert name not in yaml.safe_load(path.read_text())["keys"]


def test_a_key_named_yes_written_by_hand_loads(tmp_path: Path) -> None:
    path, text = _repo_copy(tmp_path)
    path.write_text(text.replace("\nkeys:\n", f"\nkeys:\n  yes:\n    sha256: {'a' * 64}\n"
                                 "    rpm: 5\n    tpm: 500\n", 1))
    listed = tokengate("keys", "list", "--json", "--config", path, "--redis-url",
                       "redis://127.0.0.1:1/0")
    assert listed.returncode == 0, listed.stderr
    assert [k["name"] for k in json.loads(listed.stdout)["keys"]] == ["yes", "demo"]


def test_a_ten_thousand_character_name_is_cut_in_the_error(tmp_path: Path) -> None:
    path, text = _repo_copy(tmp_path)
    name = "a" * 10_000
    made = tokengate("keys", "create", name, "--rpm", "5", "--tpm", "500", "--config", path,
                     "--no-apply")
    assert (made.returncode, made.stdout) == (1, "")
    assert made.stderr.splitlines() == [
        (f"keys.{'a' * 64}... (10000 characters): a key id is 1-64 letters, digits, '.', "
        "'_', '-' or '@', starting with a letter or digit"), f"{path}: not changed"]
    gone = tokengate("keys", "revoke", name, "--config", path, "--no-apply")
    assert (gone.returncode, gone.stderr) == (
        2, f"tokengate keys: no key '{'a' * 64}'... (10000 characters)\n")
    assert path.read_text() == text


@dataclass
class Host(HostFiles):
    """A host with an install, simulated below a folder of the test's (the real /etc is
    not touched: ``tokengate.config.loading.SYSTEM_CONFIG`` points there): ROOT/etc/tokengate/
    tokengate.yaml and its edge.json, and ROOT/run/nginx.pid naming a live process that
    a SIGHUP would end; and a checkout with its own tokengate.yaml, the current
    directory."""

    checkout: Path
    master: subprocess.Popen[bytes]


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    root, checkout = tmp_path / "root", tmp_path / "checkout"
    (root / "etc/tokengate").mkdir(parents=True)
    (root / "run").mkdir()
    checkout.mkdir()
    installed, _ = _repo_copy(root / "etc/tokengate")
    _repo_copy(checkout)
    compile_config.write(installed, root / "etc/tokengate/edge.json")
    master = subprocess.Popen(["sleep", "600"])
    (root / "run/nginx.pid").write_text(f"{master.pid}\n")
    monkeypatch.setattr(tg_config.loading, "SYSTEM_CONFIG", installed)
    monkeypatch.delenv(tg_config.CONFIG_ENV, raising=False)
    monkeypatch.chdir(checkout)
    try:
        yield Host(root, checkout, master)
    finally:
        master.kill()
        master.wait()


def cli(*args: str | Path) -> tuple[int, str, str]:
    """``tokengate ARGS`` in this process (so that the simulated host applies):
    (exit status, stdout, stderr)."""
    r = tokengate(*args)
    return r.returncode, r.stdout, r.stderr


def test_on_a_host_with_an_install_commands_use_the_installed_config_and_say_so(host: Host) -> None:
    checkout_text = (host.checkout / "tokengate.yaml").read_text()
    said = (f"tokengate: configuration {host.config} (the installed configuration; "
            "--config FILE for another)")
    status, out, err = cli("config", "check")
    assert status == 0, err
    assert out.startswith(f"{host.config}: ok: ")
    assert err.splitlines() == [said]
    status, out, err = cli("keys", "create", "ops", "--rpm", "5", "--tpm", "500",
                           "--no-apply")
    assert status == 0, err
    assert err.splitlines()[0] == said
    assert "ops" in yaml.safe_load(host.config.read_text())["keys"]
    assert (host.checkout / "tokengate.yaml").read_text() == checkout_text
    # the checkout's file when asked for, said with --verbose
    status, out, err = cli("config", "check", "tokengate.yaml", "--verbose")
    assert status == 0, err
    assert err.splitlines() == [(f"tokengate: configuration {host.checkout / 'tokengate.yaml'} "
                                "(given)")]
    status, out, err = cli("keys", "list", "--config", "tokengate.yaml",
                           "--redis-url", "redis://127.0.0.1:1/0")
    assert (status, err) == (0, "")
    assert "ops" not in out


def test_keys_on_a_checkouts_config_never_reload_the_installed_edge(host: Host) -> None:
    edge_json = host.edge_json.read_bytes()
    local = host.checkout / "tokengate.yaml"
    status, _out, err = cli("keys", "create", "dev", "--rpm", "5", "--tpm", "500",
                           "--config", "tokengate.yaml", "--redis-url", "redis://127.0.0.1:1/0")
    assert status == 0, err
    run = host.checkout / "var/run/nginx"
    assert err.splitlines() == [
        "created key 'dev': the key above is shown only now",
        (f"no running edge of {local} ({run / 'nginx.pid'} with {run / 'edge.json'}; --edge "
        "DIR for another): nothing reloaded"),
        ("tokengate keys: the change is made but was not audited (Redis: Error 111 "
         "connecting to 127.0.0.1:1. Connection refused.)")]
    assert host.master.poll() is None  # no SIGHUP reached the installed nginx
    assert host.edge_json.read_bytes() == edge_json
    assert "dev" not in yaml.safe_load(host.config.read_text())["keys"]
    # one deployment each: the installed file's edge is the install's, never make run's
    assert keys.find_edges(local, []) == []
    assert keys.find_edges(host.config, []) == [
        keys.EdgeTarget(host.edge_json, host.root / "run/nginx.pid")]


# --- an installed host, the services as their own user --------------------------------

SERVICE_USER = "nobody"  # stands in for the units' User=tokengate, with their Group=www-data
SIDECARS_DIR = Path(tg_config.__file__).resolve().parents[2]  # the code under test


def service_bin_dir(bin_dir: Path) -> Path:
    """The bin folder of a virtualenv that the service user can run, as an operator's
    (Debian's own Python, outside /root, where the development virtualenv lives): the
    runtime's dependencies from pip, built once per set of dependencies and kept in /tmp
    (a clean clone reuses it); one script per entry point in ``bin_dir`` (made here),
    each putting the code under test first on the path (spawned workers inherit
    it), so two checkouts' runs never re-point each other's scripts."""
    project = tomllib.loads((SIDECARS_DIR / "pyproject.toml").read_text())["project"]
    deps, scripts = project["dependencies"], project["scripts"]
    py = Path("/usr/bin/python3")
    stamp = json.dumps([deps, py.resolve().name])
    venv = Path(f"/tmp/tokengate-test-service-venv-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}")
    with open(f"{venv}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([str(py), "-m", "venv", str(venv)], check=True, timeout=300)
            r = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", *deps],
                               capture_output=True, text=True, timeout=900, check=False)
            assert r.returncode == 0, r.stdout + r.stderr
            (venv / ".complete").write_text(stamp)
    bin_dir.mkdir(mode=0o755)
    for name, target in scripts.items():
        module, func = target.split(":")
        script = bin_dir / name
        # the guard: the sidecars' workers are spawned, which imports this again
        script.write_text(f"#!{venv}/bin/python\nimport sys\n"
                          f"sys.path.insert(0, {str(SIDECARS_DIR)!r})\n"
                          f"from {module} import {func}\nif __name__ == '__main__':\n"
                          f"    sys.exit({func}())\n")
        script.chmod(0o755)
    return bin_dir


def as_service_user(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={SERVICE_USER}", "--regid=www-data",
                           "--clear-groups", "--", *map(str, argv)],
                          capture_output=True, text=True, timeout=30, check=False)


def _count_lines(run: units.Running, text: str) -> int:
    return run.log.read_text(errors="replace").count(text)


def test_key_commands_on_an_install_keep_the_files_readable_by_the_services(
        config_path: Path, fast_upstream_url: str) -> None:
    """`tokengate keys create` / `revoke` as root on a layout of `tokengate install`:
    tokengate.yaml went from root:www-data 0640 to root:root 0640 (and edge.json to
    0644 root:root), so the counter's SIGHUP reload failed with PermissionError and its
    next start did not come up. Here the counter runs from its installed unit as the
    service user (group www-data only), Debian's nginx on the installed drop-in."""
    root = Path(tempfile.mkdtemp(prefix="tg-keys-host-", dir="/tmp"))
    bin_dir = service_bin_dir(root / "venv-bin")
    running: list[units.Running] = []
    nginx: Service | None = None
    try:
        os.chmod(root, 0o755)  # nginx's www-data workers and the service user enter it
        port = free_port()
        conf = debian_layout(root, port)
        raw = yaml.safe_load(config_path.read_text())
        hostport = fast_upstream_url.removeprefix("http://").removesuffix("/v1")
        raw["models"] = {MODEL: {**raw["models"][MODEL], "upstreams": [hostport],
                                 "embedded": False}}
        raw.setdefault("edge", {})["status_listen"] = f"127.0.0.1:{free_port()}"
        source = root / "source-tokengate.yaml"
        source.write_text(yaml.safe_dump(raw, sort_keys=False))
        r = subprocess.run([str(Path(sys.executable).parent / "tokengate"), "install",
                            "--prefix", root, "--source", REPO_CONFIG.parent, "--config",
                            source, "--bin-dir", bin_dir, "--vllm-python", sys.executable],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        # what install gives the tokengate user on a host (root stands in under a prefix)
        for d in ("run/tokengate", "var/lib/tokengate", "var/lib/tokengate/engine"):
            shutil.chown(root / d, SERVICE_USER, "www-data")
        config, edge_json = root / "etc/tokengate/tokengate.yaml", root / "etc/tokengate/edge.json"
        installed = {p: (oct(p.stat().st_mode & 0o7777), p.stat().st_uid, p.stat().st_gid)
                     for p in (config, edge_json)}
        www_data = grp.getgrnam("www-data").gr_gid
        assert set(installed.values()) == {("0o640", 0, www_data)}

        unit = root / "etc/systemd/system/tokengate-counter.service"
        counter = units.start(unit, root, root / "var/log/first", user=SERVICE_USER)
        running.append(counter)
        socks = [root / f"run/tokengate/counter.sock.{i}" for i in range(2)]
        counter.wait_for(lambda: _count_lines(counter, "listening on") == 2, 120,
                         "socket of each worker")
        nginx = Service("debian-nginx", ["nginx", "-c", str(conf), "-g", "daemon off;"],
                        tcp_ready("127.0.0.1", port), start_timeout_s=30,
                        log_dir=root / "var/log").start()

        made = tokengate("keys", "create", "ops", "--rpm", "100", "--tpm", "100000",
                         "--config", config)
        assert made.returncode == 0, made.stderr
        # the install's own edge, found from the file's place (no --edge)
        # (then, with no Redis here, that the change could not be audited)
        assert f"applied: {edge_json} (nginx reloaded)" in made.stderr.splitlines()
        for p, before in installed.items():
            assert (oct(p.stat().st_mode & 0o7777), p.stat().st_uid, p.stat().st_gid) == \
                before, p
            read = as_service_user("cat", p)
            assert read.returncode == 0, read.stderr
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                               api_key=made.stdout.strip(), max_retries=0, timeout=60)
        assert _chat(client).usage.completion_tokens == 4

        # systemctl reload tokengate-counter: ExecReload=/bin/kill -HUP $MAINPID
        counter.proc.send_signal(signal.SIGHUP)
        counter.wait_for(lambda: _count_lines(counter, "configuration reloaded") == 2
                         or "reload failed" in counter.log.read_text(), 60,
                         "a reload of each worker")
        assert "reload failed" not in counter.log.read_text(), counter.log_tail()
        # systemctl restart tokengate-counter
        counter.stop()
        for s in socks:
            s.unlink(missing_ok=True)
        again = units.start(unit, root, root / "var/log/again", user=SERVICE_USER)
        running.append(again)
        again.wait_for(lambda: _count_lines(again, "listening on") == 2, 120,
                       "socket of each worker")
        assert _chat(client).usage.completion_tokens == 4

        gone = tokengate("keys", "revoke", "ops", "--config", config)
        assert gone.returncode == 0, gone.stderr
        for p, before in installed.items():
            assert (oct(p.stat().st_mode & 0o7777), p.stat().st_uid, p.stat().st_gid) == \
                before, p
        with pytest.raises(openai.AuthenticationError):
            _chat(client)
    finally:
        if nginx is not None:
            nginx.stop()
        for run in running:
            run.stop()
        shutil.rmtree(root, ignore_errors=True)


# --- rotation, expiry, disable/enable, the audit stream ------------------------------

def _refusal(client: openai.OpenAI) -> tuple[int, str, str]:
    """(status, code, message) of a request the edge refuses."""
    with pytest.raises(openai.AuthenticationError) as e:
        _chat(client)
    body = e.value.body
    assert isinstance(body, dict)
    return e.value.status_code, body["code"], body["message"]


def test_a_rotated_key_keeps_its_old_secret_until_the_overlap_ends(
        keys_edge: tuple[Edge, Path, Path]) -> None:
    edge, path, prefix = keys_edge
    old_key = created("rotated", "--rpm", "100", "--tpm", "100000",
                      "--config", path, "--edge", prefix)
    turned = tokengate("keys", "rotate", "rotated", "--overlap", "1h", "--config", path,
                       "--edge", prefix)
    assert turned.returncode == 0, turned.stderr
    new_key = turned.stdout.strip()
    assert new_key.startswith("tg-") and new_key != old_key
    assert "rotated key 'rotated': the key above is shown only now; the old one is valid " \
           "until 20" in turned.stderr
    entry = yaml.safe_load(path.read_text())["keys"]["rotated"]
    assert entry["sha256"] == keys.digest(new_key)
    [prev] = entry["previous"]
    assert prev["sha256"] == keys.digest(old_key)
    until = timestamp(prev["expires_at"])
    assert 3590 <= until.timestamp() - time.time() <= 3600
    old = openai.OpenAI(base_url=edge.base_url, api_key=old_key, max_retries=0)
    new = openai.OpenAI(base_url=edge.base_url, api_key=new_key, max_retries=0)
    for client in (old, new):  # both secrets are the same key
        reply = _chat(client)
        assert reply.usage is not None and reply.usage.completion_tokens == 4

    # the overlap ends: an edge.json whose previous digest has expired refuses it like an
    # unknown key (the time as the edge compares it: whole seconds, its wall clock)
    text = path.read_text().replace(prev["expires_at"], "2026-01-01T00:00:00Z")
    path.write_text(text)
    assert [why for _, why in keys.apply_to(tg_config.load(path), [prefix])] == [None]
    assert _refusal(old) == (401, "invalid_api_key", "Incorrect API key provided.")
    assert _chat(new).usage.completion_tokens == 4  # type: ignore[union-attr]
    # and the next keys command drops it from the file
    owned = tokengate("keys", "set", "rotated", "--owner", "team-a", "--config", path,
                      "--edge", prefix)
    assert owned.returncode == 0, owned.stderr
    entry = yaml.safe_load(path.read_text())["keys"]["rotated"]
    assert "previous" not in entry and entry["owner"] == "team-a"


def test_rotating_with_no_overlap_refuses_the_old_secret_at_once(tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    tokengate("keys", "create", "k", "--rpm", "1", "--tpm", "10", "--config", path,
              "--no-apply")
    turned = tokengate("keys", "rotate", "k", "--overlap", "0", "--config", path,
                       "--no-apply")
    assert turned.returncode == 0, turned.stderr
    assert "the old one is refused from now on" in turned.stderr
    entry = yaml.safe_load(path.read_text())["keys"]["k"]
    assert entry["sha256"] == keys.digest(turned.stdout.strip()) and "previous" not in entry
    bad = tokengate("keys", "rotate", "k", "--overlap", "1w", "--config", path, "--no-apply")
    assert bad.returncode == 2
    assert "expected a duration such as 90s, 30m, 24h or 7d, got '1w'" in bad.stderr


def test_a_disabled_key_is_refused_saying_so_and_works_once_enabled(
        keys_edge: tuple[Edge, Path, Path]) -> None:
    edge, path, prefix = keys_edge
    key = created("switched", "--rpm", "100", "--tpm", "100000",
                  "--config", path, "--edge", prefix)
    client = openai.OpenAI(base_url=edge.base_url, api_key=key,
                           max_retries=0)
    off = tokengate("keys", "disable", "switched", "--config", path, "--edge", prefix)
    assert off.returncode == 0 and "disabled key 'switched'" in off.stderr, off.stderr
    assert _refusal(client) == (401, "invalid_api_key", ("This API key is disabled. Ask "
                                                         "the gateway's operator to "
                                                         "enable it."))
    assert yaml.safe_load(path.read_text())["keys"]["switched"]["disabled"] is True
    claude = anthropic.Anthropic(base_url=edge.base_url.removesuffix("/v1"),
                                 api_key=key, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        claude.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"type": "error", "error": {
        "type": "authentication_error",
        "message": "This API key is disabled. Ask the gateway's operator to enable it."}}
    on = tokengate("keys", "enable", "switched", "--config", path, "--edge", prefix)
    assert on.returncode == 0 and "enabled key 'switched'" in on.stderr, on.stderr
    assert "disabled" not in yaml.safe_load(path.read_text())["keys"]["switched"]
    assert _chat(client).usage.completion_tokens == 4


def test_a_key_past_its_expiry_is_refused_with_the_time_until_it_is_extended(
        keys_edge: tuple[Edge, Path, Path]) -> None:
    edge, path, prefix = keys_edge
    key = created("expiring", "--rpm", "100", "--tpm", "100000",
                  "--expires-at", "2026-01-01T01:00:00+01:00", "--config", path,
                  "--edge", prefix)
    assert yaml.safe_load(path.read_text())["keys"]["expiring"]["expires_at"] == \
        "2026-01-01T00:00:00Z"
    client = openai.OpenAI(base_url=edge.base_url, api_key=key,
                           max_retries=0)
    assert _refusal(client) == (401, "invalid_api_key", ("This API key expired at "
                                                         "2026-01-01T00:00:00Z. Ask the "
                                                         "gateway's operator for a new "
                                                         "one."))
    later = tokengate("keys", "set", "expiring", "--expires-at", "2099-01-01T00:00:00Z",
                      "--config", path, "--edge", prefix)
    assert later.returncode == 0, later.stderr
    assert _chat(client).usage.completion_tokens == 4
    never = tokengate("keys", "set", "expiring", "--expires-at", "never", "--config", path,
                      "--edge", prefix)
    assert never.returncode == 0, never.stderr
    assert "expires_at" not in yaml.safe_load(path.read_text())["keys"]["expiring"]


def test_an_expiry_without_an_offset_is_refused(tmp_path: Path) -> None:
    path, text = _repo_copy(tmp_path)
    bad = tokengate("keys", "create", "k", "--rpm", "1", "--tpm", "10", "--expires-at",
                    "2027-01-01T00:00:00", "--config", path, "--no-apply")
    assert bad.returncode == 2
    assert "expected an RFC 3339 time with its offset" in bad.stderr
    path.write_text(text.replace("keys:\n", "keys:\n  hand:\n    sha256: " + "a" * 64
                                 + "\n    rpm: 1\n    tpm: 10\n"
                                 "    expires_at: 2027-01-01 00:00:00\n", 1))
    with pytest.raises(tg_config.ConfigError) as e:
        tg_config.load(path)
    assert "keys.hand.expires_at: 2027-01-01T00:00:00 has no offset: add Z (UTC) or " \
           "+HH:MM" in e.value.errors


def test_owner_and_description_are_listed_and_bounded(tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    created("labelled", "--rpm", "7", "--tpm", "700", "--owner",
            "Data team <data@example.com>", "--description", "nightly batch",
            "--config", path, "--no-apply")
    listed = tokengate("keys", "list", "--config", path, "--redis-url",
                       "redis://127.0.0.1:1/0")
    assert "labelled: rpm 7, tpm 700, models all\n  owner: Data team <data@example.com>\n" \
           "  description: nightly batch\n" in listed.stdout
    long = tokengate("keys", "set", "labelled", "--owner", "x" * 129, "--config", path,
                     "--no-apply")
    assert long.returncode == 1
    assert "keys.labelled.owner: string should have at most 128 characters" in long.stderr


def test_every_keys_command_is_written_to_the_audit_stream_without_a_secret(
        tmp_path: Path, redis_url: str, ledger_redis: Any) -> None:
    path, _ = _repo_copy(tmp_path)
    common = ("--config", path, "--no-apply", "--redis-url", redis_url)
    secrets = []
    for argv in (("create", "audited", "--rpm", "7", "--tpm", "700", "--owner", "ops"),
                 ("rotate", "audited", "--overlap", "30m"),
                 ("disable", "audited"), ("enable", "audited"),
                 ("set", "audited", "--rpm", "8"), ("revoke", "audited")):
        r = tokengate("keys", *argv, *common)
        assert r.returncode == 0 and "not audited" not in r.stderr, r.stderr
        secrets += [line for line in r.stdout.split() if line.startswith("tg-")]
    entries = [fields for _, fields in ledger_redis.xrange(redis_keys.AUDIT_KEY)]
    assert [(e["kind"], e["action"], e["key"], e["result"]) for e in entries] == \
        [("cli", a, "audited", "ok") for a in ("key_created", "key_rotated", "key_disabled",
                                              "key_enabled", "key_changed", "key_revoked")]
    assert {e["admin"] for e in entries} == {pwd.getpwuid(os.getuid()).pw_name}
    assert json.loads(entries[0]["detail"]) == {"owner": "ops", "rpm": 7, "tpm": 700}
    assert json.loads(entries[4]["detail"]) == {"rpm": 8}
    assert json.loads(entries[2]["detail"]) == {"disabled": True}
    assert len(secrets) == 2
    for e in entries:
        for secret in secrets:
            assert secret not in json.dumps(e) and keys.digest(secret) not in json.dumps(e)


def test_console_passwd_and_role_are_written_to_the_audit_stream_without_a_secret(
        tmp_path: Path, redis_url: str, ledger_redis: Any) -> None:
    path, _ = _repo_copy(tmp_path)
    secret = "a long enough password"
    for argv in (("passwd", "bob", "--password-stdin", "--role", "read-only"),
                 ("role", "bob", "admin"), ("passwd", "bob", "--remove")):
        r = tokengate("console", *argv, "--config", path, "--redis-url", redis_url,
                      stdin=secret + "\n")
        assert r.returncode == 0 and "not audited" not in r.stderr, r.stderr
    entries = [fields for _, fields in ledger_redis.xrange(redis_keys.AUDIT_KEY)]
    assert [(e["kind"], e["action"], e["key"], json.loads(e["detail"]), e["result"])
            for e in entries] == [
        ("cli", "admin_password_set", "", {"admin": "bob", "role": "read-only"}, "ok"),
        ("cli", "admin_role_set", "", {"admin": "bob", "role": "admin"}, "ok"),
        ("cli", "admin_removed", "", {"admin": "bob"}, "ok")]
    assert {e["admin"] for e in entries} == {pwd.getpwuid(os.getuid()).pw_name}
    assert "scrypt" not in json.dumps(entries) and secret not in json.dumps(entries)


def test_with_redis_down_a_change_applies_and_says_it_was_not_audited(
        tmp_path: Path) -> None:
    path, _ = _repo_copy(tmp_path)
    r = tokengate("keys", "create", "unaudited", "--rpm", "7", "--tpm", "700", "--config",
                  path, "--no-apply", "--redis-url", "redis://127.0.0.1:1/0")
    assert r.returncode == 0, r.stderr
    assert "unaudited" in yaml.safe_load(path.read_text())["keys"]
    assert "tokengate keys: the change is made but was not audited (Redis: " in r.stderr
