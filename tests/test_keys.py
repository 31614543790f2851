"""``tokengate keys`` against a running edge: real nginx, the real counter, TokenStorm's
fast upstream as the model server, the official openai client.

A key the CLI creates is admitted as soon as the command returns and a revoked one is
refused as soon as it returns (the command reloads the edge and waits for its new
workers); a key limited to one model cannot use another and sees only its own in
/v1/models; an edit that the schema refuses leaves the file as it was.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.conftest import MODEL, REPO_CONFIG
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, PORT_OFFSET, Edge

OTHER = "other-qwen3"  # a second served model (the same files; never reached here)


def _with_fast(upstream: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [upstream]
        raw["models"][MODEL]["embedded"] = False
        raw["models"][OTHER] = {**raw["models"][MODEL], "upstreams": [upstream]}
    return edit


def tokengate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The ``tokengate`` CLI of this checkout."""
    return subprocess.run([sys.executable, "-m", "tokengate.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


def _repo_copy(tmp_path: Path) -> tuple[Path, str]:
    """The repository's tokengate.yaml (comments and all) with global limits on, in
    ``tmp_path``: (its path, its text)."""
    text = REPO_CONFIG.read_text().replace(
        "dir: var/models/", f"dir: {REPO_CONFIG.parent / 'var' / 'models'}/").replace(
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
    made = tokengate("keys", "create", "cli-made", "--rpm", "100", "--tpm", "100000",
                     "--config", path, "--edge", prefix)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
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
    made = tokengate("keys", "create", "one-model", "--rpm", "100", "--tpm", "100000",
                     "--models", MODEL, "--config", path, "--edge", prefix)
    assert made.returncode == 0, made.stderr
    client = openai.OpenAI(base_url=edge.base_url, api_key=made.stdout.strip(),
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
    made = tokengate("keys", "create", "listed", "--rpm", "7", "--tpm", "700", "--models",
                     MODEL, "--budget", "day=2.5", "--budget", f"{MODEL}:month=1000t",
                     "--config", path, "--no-apply")
    assert made.returncode == 0, made.stderr
    listed = tokengate("keys", "list", "--json", "--config", path, "--redis-url",
                       "redis://127.0.0.1:1/0")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    entry = next(k for k in doc["keys"] if k["name"] == "listed")
    assert made.stdout.strip() not in listed.stdout
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

    def stream(_: int) -> tuple[int, str | None, str | None]:
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

    with ThreadPoolExecutor(16) as pool:
        running = [pool.submit(stream, i) for i in range(32)]
        time.sleep(0.3)  # under way: 1500 tokens at 2 ms each, >= 3 s a stream, two waves
        in_flight = []
        for i in range(2):
            made = tokengate("keys", "create", f"during-{i}", "--rpm", "10", "--tpm", "1000",
                             "--config", path, "--edge", prefix)
            assert made.returncode == 0, made.stderr
            in_flight.append(sum(not f.done() for f in running))
        results = [f.result() for f in running]
    assert in_flight[0] > 0  # the reloads happened while streams were being answered
    assert results == [(1500, "length", r[2]) for r in results]
    assert all(ev["status"] == 200 and not ev["client_aborted"]
               and ev["completion_tokens"] == 1500
               for ev in edge.events() if ev["key_id"] == "edge-main")
    assert len([ev for ev in edge.events() if ev["key_id"] == "edge-main"]) == 32


def test_a_budget_below_a_ten_thousandth_is_written_as_typed(tmp_path: Path) -> None:
    """A float written by repr (5e-05) is a string to the configuration's YAML reader:
    the key was refused with "spend: input should be a valid number"."""
    path, _ = _repo_copy(tmp_path)
    made = tokengate("keys", "create", "tiny-budget", "--rpm", "5", "--tpm", "500",
                     "--budget", "day=0.00005", "--config", path, "--no-apply")
    assert made.returncode == 0, made.stderr
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
     "tokengate keys: --budget: two day spend limits for every model"),
    (["create", "x", "--rpm", "6", "--tpm", "9", "--models", "other-qwen3", "--budget",
      f"{MODEL}:day=5"], "keys.x.budgets.0.model: not one of the key's allowed_models"),
    (["set", "demo"], ("tokengate keys: nothing to change: give --rpm, --tpm, --models, "
                       "--budget or --no-budgets")),
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
    made = tokengate("keys", "create", "last", "--rpm", "5", "--tpm", "500", "--budget",
                     "day=1", "--budget", f"{MODEL}:month=2.50", "--config", path, "--no-apply")
    assert made.returncode == 0, made.stderr
    edited = path.read_text()
    assert heading in edited
    keys_block = edited[edited.index("\nkeys:\n"):edited.index(heading)]
    assert keys_block.rstrip().endswith(
        f"  last:\n    sha256: {hashlib.sha256(made.stdout.strip().encode()).hexdigest()}\n"
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
    made = tokengate("keys", "create", "both", "--rpm", "5", "--tpm", "500", "--budget",
                     "day=1", "--budget", "day=2000t", "--config", path, "--no-apply")
    assert made.returncode == 0, made.stderr
    changed = tokengate("keys", "set", "both", "--budget", "day=3", "--config", path,
                        "--no-apply")  # sets the spend limit; the token quota stays
    assert changed.returncode == 0, changed.stderr
    listed = json.loads(tokengate("keys", "list", "--json", "--config", path,
                                  "--redis-url", "redis://127.0.0.1:1/0").stdout)
    entry = next(k for k in listed["keys"] if k["name"] == "both")
    assert [(b["period"], b["model"], b["spend"], b["tokens"]) for b in entry["budgets"]] == \
        [("day", None, 3, 2000)]
