"""tokengate.yaml's schema: unknown keys, wrong types and coupled settings are refused with
the dotted path of the key; the repository's file passes; `tokengate config check` says
so on the command line; the JSON Schema and docs/config.md come from the same models; the
edge's Lua loads the compiled dump as written and refuses a stale one.
(Over 600 lines: one schema's refusals, table-driven, over one copy of the
repository's file and its edit helpers.)"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokengate import config as tg_config
from tokengate.config import ConfigError, loading
from tokengate.tools import compile_config, config_docs

from tests.cli_calls import tokengate
from tests.conftest import MODEL, REPO_CONFIG, TEST_MAX_MODEL_LEN
from tests.fixtures_edge import run_lua

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

DOCS = REPO_CONFIG.parent / "docs" / "config.md"
TOKENGATE = Path(sys.executable).parent / "tokengate"
DEMO = "e7aab4b439baa8c615eb31e352f5b4259085813fbcd95a65a5a346a6bdfb1bb3"

Edit = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def repo_raw() -> dict[str, Any]:
    return yaml.safe_load(REPO_CONFIG.read_text())


def errors_of(raw: dict[str, Any], edit: Edit, where: Path) -> list[str]:
    changed = copy.deepcopy(raw)
    edit(changed)
    with pytest.raises(ConfigError) as e:
        tg_config.parse(changed, where / "tokengate.yaml")
    assert str(e.value) == "\n".join(e.value.errors)
    return e.value.errors


def put(path: str, value: Any) -> Edit:
    """An edit that sets the dotted ``path`` (creating sections on the way)."""
    def edit(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return edit


def every(*edits: Edit) -> Edit:
    def edit(raw: dict[str, Any]) -> None:
        for e in edits:
            e(raw)
    return edit


def test_the_repository_file_passes() -> None:
    cfg = tg_config.load(REPO_CONFIG)
    m = cfg.models[MODEL]
    assert (m.name, m.max_model_len, m.output_reserve, m.max_tokens_cap, m.max_n) == \
        (MODEL, 65536, 256, 4096, 8)
    assert m.dir == REPO_CONFIG.parent / "var/models/tiny-qwen3"
    assert cfg.keys["demo"].sha256 == DEMO and (cfg.keys["demo"].rpm, cfg.keys["demo"].tpm) \
        == (600, 200000)
    assert cfg.path == REPO_CONFIG
    assert cfg.edge.counter_backoff_ms == 500
    assert cfg.ledger.usage_file == REPO_CONFIG.parent / "var/usage/usage.jsonl"
    assert cfg.global_limits.unix_socket == REPO_CONFIG.parent / "var/run/limits.sock"


@pytest.mark.parametrize("path", [
    "modles",                                   # top level
    f"models.{MODEL}.max_token_cap",            # the example: a cap silently lost
    f"models.{MODEL}.cost.inptu",
    "keys.demo.rmp",
    f"keys.demo.models.{MODEL}.tmp",
    "edge.count_timeout",
    "billing.context_penalty.treshold",
    "access_log.files",
])
def test_a_typo_is_refused_with_its_path(repo_raw: dict[str, Any], tmp_path: Path,
                                          path: str) -> None:
    def edit(raw: dict[str, Any]) -> None:
        if path.startswith(f"keys.demo.models.{MODEL}"):
            raw["keys"]["demo"]["models"] = {MODEL: {"rpm": 1, "tpm": 1}}
        put(path, 1)(raw)
    assert errors_of(repo_raw, edit, tmp_path) == [f"{path}: unknown key"]


@pytest.mark.parametrize("path,value,message", [
    (f"models.{MODEL}.max_model_len", "8192", "input should be a valid integer, got '8192'"),
    (f"models.{MODEL}.max_model_len", True, "input should be a valid integer, got True"),
    (f"models.{MODEL}.output_reserve", 0, "input should be greater than or equal to 1, got 0"),
    (f"models.{MODEL}.vocab", "tiktoken",
     "input should be 'auto', 'hf' or 'qwen3.6', got 'tiktoken'"),
    (f"models.{MODEL}.upstreams", ["localhost"],
     "expected host:port (port 1..65535), got 'localhost'"),
    (f"models.{MODEL}.upstreams", [], "list should have at least 1 item after validation, not 0, got []"),
    (f"models.{MODEL}.cost.output", "1.35", "input should be a valid number, got '1.35'"),
    (f"models.{MODEL}.idle_unload.idle_s", -1,
     "input should be greater than or equal to 0, got -1"),
    (f"models.{MODEL}.idle_unload.level", 2, "unknown key"),
    ("keys.demo.sha256", "abc",
     "expected the key's SHA-256 as 64 hex digits (printf %s \"$KEY\" | sha256sum)"),
    ("keys.demo.tpm", 1.5, "input should be a valid integer, got 1.5"),
    ("redis.url", "http://127.0.0.1:6380",
     "expected a redis://, rediss:// or unix:// URL, got 'http://127.0.0.1:6380'"),
    ("global_limits.enabled", "yes", "input should be a valid boolean, got 'yes'"),
    ("access_log.rate", 1.5, "input should be less than or equal to 1, got 1.5"),
    ("access_log.file", 3, "expected a path, or false for none, got 3"),
    ("edge.on_counter_failure", "maybe",
     "input should be 'open' or 'closed', got 'maybe'"),
    ("edge.max_body_bytes", 128 << 20,
     "input should be less than or equal to 67108864, got 134217728"),
    ("edge.special_token_roles", ["user", "usr"],
     ("input should be 'system', 'developer', 'user', 'assistant', 'tool' or 'function', "
      "got 'usr'")),
    ("edge.chat_template_kwargs_allowed", ["enable_thinking", "tools"],
     "tools cannot be allowed: the request sets it through checked fields, or vLLM does"),
    ("edge.structured_output.max_properties", 0,
     "input should be greater than or equal to 1, got 0"),
    ("edge.max_unknown_fields_bytes", -1, "input should be greater than or equal to 0, got -1"),
    ("currency", 3, "input should be a valid string, got 3"),
    ("tracing.endpoint", "127.0.0.1:4317",
     "expected http://host:port or https://host:port, got '127.0.0.1:4317'"),
    ("tracing.endpoint", "http://collector",
     "'http://collector' names no port (OTLP's are 4317 for gRPC, 4318 for HTTP)"),
    ("tracing.protocol", "http/json",
     "input should be 'grpc' or 'http/protobuf', got 'http/json'"),
    ("tracing.sample_ratio", 2, "input should be less than or equal to 1, got 2"),
    ("tracing.headers", {"bad header": "x"}, "'bad header' is not an HTTP header name"),
    ("tracing.timeout_s", 0, "input should be greater than 0, got 0"),
    ("tracing.headers.x-a", "v\u00e4lue", "'v\u00e4lue': expected printable ASCII, not empty"),
    ("tracing.endpoint", "http://127.0.0.1:99999",
     "'http://127.0.0.1:99999': the port is not in 1..65535"),
    ("tracing.service_name", "a\nb", "'a\\nb': expected printable ASCII, not empty"),
    ("tracing.resource_attributes", {"service.name": "x"},
     "service.name is tracing.service_name"),
])
def test_a_wrong_value_is_refused_with_its_path(repo_raw: dict[str, Any], tmp_path: Path,
                                                path: str, value: Any, message: str) -> None:
    # a list's error names the offending item
    where = path + {"edge.special_token_roles": ".1", f"models.{MODEL}.upstreams": ".0"}.get(
        path, "") * bool(value)
    assert errors_of(repo_raw, put(path, value), tmp_path) == [f"{where}: {message}"]


def _numbers(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(model.field, JSON Schema node) of every integer or number the schema has."""
    for name, model in schema["$defs"].items():
        for field, prop in model.get("properties", {}).items():
            for node in [prop, *prop.get("anyOf", [])]:
                if node.get("type") in ("integer", "number"):
                    yield f"{name}.{field}", node


def test_every_number_of_the_schema_is_finite_and_bounded() -> None:
    """Each is held to what the code downstream holds (the edge's Lua doubles, the
    uint64 wire, Redis): counts and durations to MAX_COUNT, amounts of the currency to
    MAX_AMOUNT; .inf, .nan and 1e308 had passed `config check` as prices, the context
    penalty's rate and slow_ms."""
    numbers = dict(_numbers(tg_config.Config.model_json_schema()))
    assert len(numbers) >= 60
    unbounded = [f for f, n in numbers.items()
                 if "maximum" not in n or ("minimum" not in n and "exclusiveMinimum" not in n)]
    assert unbounded == []
    assert max(n["maximum"] for n in numbers.values()) == tg_config.MAX_COUNT == 10**12
    amounts = {f: n["maximum"] for f, n in numbers.items()
               if f.startswith(("ModelCost.", "Budget.spend"))}
    assert amounts == {"ModelCost.input": 1e9, "ModelCost.output": 1e9,
                       "ModelCost.cached": 1e9, "ModelCost.batch": 1.0, "Budget.spend": 1e9}
    # every limit the edge sends on the wire (uint64) fits in Lua's exact integers
    assert tg_config.MAX_COUNT < 2**53 and tg_config.MAX_AMOUNT * 1e9 < 2**63


FINITE = "input should be a finite number, got {}"


@pytest.mark.parametrize("path,text,message", [
    (f"models.{MODEL}.cost.input", ".inf", FINITE.format("inf")),
    (f"models.{MODEL}.cost.output", "1.0e+308",
     "input should be less than or equal to 1000000000, got 1e+308"),
    (f"models.{MODEL}.cost.cached", ".nan", FINITE.format("nan")),
    ("billing.context_penalty.rate", ".inf", FINITE.format("inf")),
    ("billing.context_penalty.rate", "1.5", "input should be less than or equal to 1, got 1.5"),
    ("billing.context_penalty.threshold", "1.0e+30", "input should be a valid integer, got 1e+30"),
    ("access_log.slow_ms", ".inf", FINITE.format("inf")),
    ("access_log.slow_rate", ".nan", FINITE.format("nan")),
    ("access_log.error_status", "1000", "input should be less than or equal to 999, got 1000"),
    ("ledger.engine_wait_s", "-.inf", FINITE.format("-inf")),
    ("ledger.engine_orphan_s", ".inf", FINITE.format("inf")),
    ("ledger.rotate_wait_s", "1.0e+13",
     "input should be less than or equal to 1000000000000, got 10000000000000.0"),
    ("ledger.dedupe_days", "100000000000000000000",
     "input should be less than or equal to 36500, got 100000000000000000000"),
    ("ledger.audit_maxlen", "10000000000000",
     "input should be less than or equal to 1000000000000, got 10000000000000"),
    ("keys.demo.rpm", "1000000000001",
     "input should be less than or equal to 1000000000000, got 1000000000001"),
    ("edge.upstream_eject_s", "99999999999999999999",
     "input should be less than or equal to 1000000000000, got 99999999999999999999"),
    ("edge.admission.priorities.low.max_waiting", "10000000000000",
     "input should be less than or equal to 1000000000000, got 10000000000000"),
    (f"models.{MODEL}.idle_unload.idle_s", "10000000000000",
     "input should be less than or equal to 1000000000000, got 10000000000000"),
])
def test_a_number_that_is_not_finite_or_past_its_bound_is_refused_with_its_path(
        repo_raw: dict[str, Any], tmp_path: Path, path: str, text: str, message: str) -> None:
    # as written in the YAML (.inf, .nan, 1.0e+308 are YAML's own floats)
    raw = copy.deepcopy(repo_raw)
    put(path, yaml.safe_load(text))(raw)
    with pytest.raises(ConfigError) as e:
        tg_config.loads(yaml.safe_dump(raw), tmp_path / "tokengate.yaml")
    assert e.value.errors == [f"{path}: {message}"]


def test_a_budgets_spend_must_be_finite(repo_raw: dict[str, Any], tmp_path: Path) -> None:
    edit = every(put("global_limits.enabled", True),
                 put("keys.demo.budgets", [{"period": "day", "spend": float("inf")},
                                           {"period": "month", "spend": float("nan")}]))
    assert errors_of(repo_raw, edit, tmp_path) == [
        f"keys.demo.budgets.0.spend: {FINITE.format('inf')}",
        f"keys.demo.budgets.1.spend: {FINITE.format('nan')}"]


@pytest.mark.parametrize("rpm", [2**32, 2**32 + 5, 10**12])
def test_an_rpm_above_2_to_the_32_is_kept_exactly_in_the_edge_document(
        repo_raw: dict[str, Any], tmp_path: Path, rpm: int) -> None:
    """The schema's bound for limits (1e12) is the wire's too: limits.proto's rpm_limit is a
    uint64 (as a uint32, 2^32 + 5 was enforced as 5; tests/edge/test_edge_global.py sends it)."""
    raw = copy.deepcopy(repo_raw)
    put("keys.demo.rpm", rpm)(raw)
    put(f"keys.demo.models.{MODEL}", {"rpm": rpm, "tpm": 10**12})(raw)
    cfg = tg_config.loads(yaml.safe_dump(raw), REPO_CONFIG)
    doc = json.loads(json.dumps(compile_config.compile_config(cfg), allow_nan=False))
    assert doc["keys"][DEMO]["rpm"] == rpm
    assert doc["keys"][DEMO]["models"][MODEL] == {"rpm": rpm, "tpm": 10**12}


def test_keys_create_takes_an_rpm_above_2_to_the_32_and_refuses_past_the_bound(
        tmp_path: Path) -> None:
    """`tokengate keys create` checks its edit with the schema: --rpm 4294967301 is written
    as given; past MAX_COUNT, or a spend past MAX_AMOUNT, nothing is written."""
    path = tmp_path / "tokengate.yaml"
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    put(f"models.{MODEL}.dir", str(REPO_CONFIG.parent / "var/models/tiny-qwen3"))(raw)
    put("global_limits.enabled", True)(raw)
    path.write_text(yaml.safe_dump(raw))

    def keys(*args: str) -> tuple[int, str]:
        r = tokengate("keys", *args, "--config", path, "--no-apply")
        return r.returncode, r.stderr

    assert keys("create", "big", "--rpm", "4294967301", "--tpm", "1000")[0] == 0
    assert tg_config.load(path).keys["big"].rpm == 4294967301
    before = path.read_text()
    status, err = keys("create", "huge", "--rpm", "1000000000001", "--tpm", "1000")
    too_many = "input should be less than or equal to 1000000000000, got 1000000000001"
    assert (status, err.splitlines()[0]) == (1, f"keys.huge.rpm: {too_many}")
    status, err = keys("create", "spender", "--rpm", "1", "--tpm", "1", "--budget",
                       "day=10000000000")
    too_much = "input should be less than or equal to 1000000000, got 10000000000"
    assert (status, err.splitlines()[0]) == (1, f"keys.spender.budgets.0.spend: {too_much}")
    # inf and nan are not amounts to the option's parser already (exit 2, usage)
    assert keys("create", "spender", "--rpm", "1", "--tpm", "1", "--budget", "day=inf")[0] \
        == 2
    assert path.read_text() == before


def test_every_problem_is_reported_one_per_line(repo_raw: dict[str, Any],
                                                tmp_path: Path) -> None:
    def drop_len(raw: dict[str, Any]) -> None:
        del raw["models"][MODEL]["max_model_len"]
    edit = every(put(f"models.{MODEL}.max_token_cap", 5), put("keys.demo.rpm", "600"),
                 put("edge.special_tokens", "drop"), drop_len)
    assert errors_of(repo_raw, edit, tmp_path) == [
        f"models.{MODEL}.max_model_len: required",
        f"models.{MODEL}.max_token_cap: unknown key",
        "keys.demo.rpm: input should be a valid integer, got '600'",
        ("edge.special_tokens: input should be 'escape', 'reject', 'strip' or 'allow', got "
         "'drop'"),
    ]


@pytest.mark.parametrize("edit,errors", [
    (put(f"models.{MODEL}.default_max_tokens", 5000),
     [f"models.{MODEL}.default_max_tokens: 5000 exceeds max_tokens_cap (4096)"]),
    (put(f"models.{MODEL}.max_tokens_cap", 70000),
     [f"models.{MODEL}.max_tokens_cap: 70000 exceeds max_model_len (65536)"]),
    (every(put(f"models.{MODEL}.max_tokens_cap", None),
           put(f"models.{MODEL}.default_max_tokens", 65537)),
     [f"models.{MODEL}.default_max_tokens: 65537 exceeds max_model_len (65536)"]),
    (put(f"models.{MODEL}.output_reserve", 70000),
     [f"models.{MODEL}.output_reserve: 70000 exceeds max_model_len (65536)"]),
    (put("keys.demo.models", {"tiny-qwen4": {"rpm": 1, "tpm": 100}}),
     [f"keys.demo.models.tiny-qwen4: 'tiny-qwen4' is not a configured model ({MODEL})"]),
    (put("keys.copy", {"sha256": DEMO.upper(), "rpm": 1, "tpm": 1}),
     ["keys.copy.sha256: same digest as keys.demo"]),
    (put("edge.global_limits_timeout_ms", 500),
     [("edge.global_limits_timeout_ms: 500 must exceed the limits sidecar's Redis deadline, "
       "2 x redis.timeout_ms = 500")]),
    (put("redis.timeout_ms", 600),
     [("edge.global_limits_timeout_ms: 1000 must exceed the limits sidecar's Redis deadline, "
       "2 x redis.timeout_ms = 1200")]),
    (every(put(f"models.{MODEL}.embedded", False),
           put(f"models.{MODEL}.upstreams", ["127.0.0.1:9", "127.0.0.1:8080"])),
     [(f"models.{MODEL}.upstreams.1: 127.0.0.1:8080 is edge.listen: the edge would proxy to "
       "itself")]),
    (every(put(f"models.{MODEL}.embedded", False),
           put(f"models.{MODEL}.upstreams", ["127.0.0.1:9", "127.0.0.1:9"])),
     [f"models.{MODEL}.upstreams: lists the same host:port twice"]),
    (every(put(f"models.{MODEL}.embedded", True),
           put(f"models.{MODEL}.upstreams", ["127.0.0.1:9", "127.0.0.1:10"])),
     [(f"models.{MODEL}.embedded: the embedded vLLM serves one loopback upstream, got "
       "['127.0.0.1:9', '127.0.0.1:10']")]),
    (put("global_limits", {"enabled": True, "listen": "127.0.0.1:8080"}),
     ["global_limits.listen: 127.0.0.1:8080 is also edge.listen"]),
    # the console's service listens whether or not an admin is set
    (put("ledger.console", {"listen": "127.0.0.1:8080"}),
     ["ledger.console.listen: 127.0.0.1:8080 is also edge.listen"]),
    (put("keys.demo.priority", "batch"),
     ["keys.demo.priority: 'batch' is not in edge.admission.priorities (low, normal)"]),
    (put("edge.admission", {"priorities": {"batch": {}}}),
     ["keys.demo.priority: 'normal' is not in edge.admission.priorities (batch)",
      "batch.priority: 'low' is not in edge.admission.priorities (batch)"]),
    (put("edge.admission", {"metrics_interval_ms": 3000}),
     ["edge.admission.metrics_stale_ms: 3000 must exceed metrics_interval_ms (3000)"]),
])
def test_coupled_settings_are_checked(repo_raw: dict[str, Any], tmp_path: Path, edit: Edit,
                                      errors: list[str]) -> None:
    assert errors_of(repo_raw, edit, tmp_path) == errors


def test_the_rules_hold_at_their_bounds(repo_raw: dict[str, Any], tmp_path: Path) -> None:
    raw = copy.deepcopy(repo_raw)
    put(f"models.{MODEL}.default_max_tokens", 4096)(raw)
    put(f"models.{MODEL}.output_reserve", 65536)(raw)
    put("edge.global_limits_timeout_ms", 501)(raw)
    put("global_limits.listen", "127.0.0.1:8080")(raw)  # disabled: never bound
    cfg = tg_config.parse(raw, tmp_path / "tokengate.yaml")
    assert cfg.models[MODEL].default_max_tokens == 4096


def test_paths_resolve_against_the_yaml_folder_and_sections_may_be_empty(
        tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "tokengate.yaml"
    path.write_text("models:\n  m: {dir: models/m, max_model_len: 1000}\n"
                    "ledger: {usage_file: u/usage.jsonl}\n"
                    "access_log: {file: false}\n"
                    "redis:\n"             # every key commented out: the defaults
                    "#  url: redis://elsewhere\n")
    cfg = tg_config.load(path)
    conf = tmp_path / "conf"
    assert cfg.models["m"].dir == conf / "models/m"
    assert cfg.ledger.usage_file == conf / "u/usage.jsonl"
    assert cfg.edge.usage_file == cfg.ledger.usage_file      # edge's default: the ledger's
    assert cfg.access_log.file is None
    assert cfg.global_limits.unix_socket is None
    assert cfg.redis == tg_config.RedisConfig()
    assert cfg.keys == {}


def test_a_key_given_twice_in_the_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokengate.yaml"
    path.write_text("models:\n  m:\n    dir: m\n    max_model_len: 100\n"
                    "    max_model_len: 200\n")
    with pytest.raises(ConfigError, match=r"^\(yaml\): line 5, column 5: duplicate key "
                                          r"'max_model_len'$"):
        tg_config.load(path)


def test_the_configuration_is_frozen() -> None:
    cfg = tg_config.load(REPO_CONFIG)
    with pytest.raises(ValueError, match="frozen"):
        cfg.models[MODEL].max_model_len = 1  # type: ignore[misc]


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv(tg_config.CONFIG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def test_the_default_file_is_env_then_the_installed_one_then_cwd(
        elsewhere: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
        ) -> None:
    """A host where /etc/tokengate/tokengate.yaml exists is simulated by pointing
    ``SYSTEM_CONFIG`` at a folder of the test's (the real /etc is not touched)."""
    system = tmp_path_factory.mktemp("host") / "etc" / "tokengate" / "tokengate.yaml"
    monkeypatch.setattr(loading, "SYSTEM_CONFIG", system)
    assert tg_config.discover() == (system, "no ./tokengate.yaml and no $TOKENGATE_CONFIG")
    (elsewhere / "tokengate.yaml").write_text("")
    assert tg_config.discover() == (
        Path("tokengate.yaml"), f"./tokengate.yaml: no {system} on this host")
    system.parent.mkdir(parents=True)
    system.write_text("")
    # an installed host: the checkout's file only when asked for
    assert tg_config.discover() == (
        system, "the installed configuration; --config FILE for another")
    assert tg_config.discover("tokengate.yaml") == (Path("tokengate.yaml"), "given")
    monkeypatch.setenv(tg_config.CONFIG_ENV, str(REPO_CONFIG))
    assert tg_config.discover() == (REPO_CONFIG, "from $TOKENGATE_CONFIG")
    assert tg_config.default_path() == REPO_CONFIG
    assert tg_config.load().path == REPO_CONFIG


def test_an_installed_config_this_user_may_not_read_is_not_replaced_by_the_checkouts(
        elsewhere: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
        ) -> None:
    """/etc/tokengate is 0750 root:www-data: a user outside the group cannot even stat
    tokengate.yaml; the command must fail on that file, not read the checkout's."""
    system = tmp_path_factory.mktemp("host") / "etc" / "tokengate" / "tokengate.yaml"
    monkeypatch.setattr(loading, "SYSTEM_CONFIG", system)
    (elsewhere / "tokengate.yaml").write_text("")

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if Path(path) == system:
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    real_stat = os.stat
    monkeypatch.setattr(os, "stat", stat)
    assert tg_config.discover()[0] == system


def test_the_compiled_edge_document_is_the_schema_dump(config_path: Path) -> None:
    cfg = tg_config.load(config_path)
    doc = compile_config.compile_config(cfg)
    assert doc["version"] == 14 and doc["source"] == str(config_path)
    assert "redis" not in doc                     # the edge never needs its URL (password)
    # nor a collector's headers (credentials); tracing is off unless asked for
    assert "headers" not in doc["tracing"] and doc["tracing"]["enabled"] is False
    m = doc["models"][MODEL]
    assert {k: m[k] for k in ("max_model_len", "output_reserve", "max_tokens_cap",
                              "default_max_tokens", "max_n")} == \
        {"max_model_len": TEST_MAX_MODEL_LEN, "output_reserve": 256, "max_tokens_cap": 4096,
         "default_max_tokens": None, "max_n": 8}
    [u] = cfg.models[MODEL].upstreams
    # idle unload is off unless asked for
    assert m["idle_unload"] == {"idle_s": 0, "max_hold_ms": 30000, "retry_after_s": 5,
                                "call_timeout_ms": 120000}
    assert m["upstreams"] == [{"name": u, "host": "127.0.0.1", "addr": "127.0.0.1",
                               "port": int(u.rpartition(":")[2]), "resolve": False}]
    assert "<|im_end|>" in m["special_tokens"]
    # added, not special, and written by the chat template; <|fim_prefix|> is added and not
    # special too, but no turn uses it
    assert m["structural_tokens"] == ["</tool_response>", "<tool_response>", "</tool_call>",
                                      "<tool_call>", "</think>", "<think>"]
    assert doc["keys"][DEMO] == {"id": "demo", "rpm": 600, "tpm": 200000, "models": {},
                                 "allowed_models": None, "budgets": [],
                                 "priority": "normal", "session_budget": None,
                                 "slo": None, "slo_class": "interactive",
                                 "fair_share": 1.0, "max_tokens_cap": None,
                                 "cached_tokens_weight": None, "previous": [],
                                 "expires_at": None, "disabled": False, "team": None,
                                 "levels": []}
    dump = cfg.edge.model_dump(mode="json")
    dump["auth_failures"]["exempt_networks"] = []  # derived: the exempt networks as bytes
    # derived: the DNS servers (edge.dns_resolvers, else resolv.conf's)
    dump["dns_servers"] = compile_config.dns_servers([])
    assert doc["edge"] == {**dump, "usage_file": str(cfg.ledger.usage_file)}
    assert doc["edge"]["counter_backoff_ms"] == 500
    assert doc["global_limits"] == {"enabled": False, "listen": "127.0.0.1:50061",
                                    "unix_socket": str(cfg.global_limits.unix_socket)}
    assert set(doc["access_log"]) == {"error_status", "slow_ms", "slow_rate", "rate", "file"}


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TOKENGATE), "config", "check", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_config_check_names_the_bad_key_and_exits_non_zero(repo_raw: dict[str, Any],
                                                           tmp_path: Path) -> None:
    raw = copy.deepcopy(repo_raw)
    put(f"models.{MODEL}.max_token_cap", 100)(raw)
    put("edge.count_timeout_ms", "500")(raw)
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = run_check(str(path))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"models.{MODEL}.max_token_cap: unknown key",
        "edge.count_timeout_ms: input should be a valid integer, got '500'",
        f"{path}: 2 problems",
    ]


def test_config_check_refuses_a_context_the_model_does_not_allow(repo_raw: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    # vLLM exits at start with a --max-model-len above the model's max_position_embeddings
    raw = copy.deepcopy(repo_raw)
    model_dir = REPO_CONFIG.parent / repo_raw["models"][MODEL]["dir"]
    put(f"models.{MODEL}.dir", str(model_dir))(raw)
    put(f"models.{MODEL}.max_model_len", 131072)(raw)
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = run_check("--config", str(path))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        (f"models.{MODEL}.max_model_len: 131072 exceeds what the model allows, 65536 "
         f"(max_position_embeddings=65536, {model_dir}/config.json): vLLM would exit at start"),
        f"{path}: 1 problem",
    ]


@pytest.mark.parametrize("files,want", [
    ({"config.json": {"max_position_embeddings": 40960}}, (40960, "max_position_embeddings=40960")),
    ({"config.json": {"text_config": {"max_position_embeddings": 8192, "seq_length": 4096}}},
     (4096, "seq_length=4096")),
    ({"config.json": {"max_position_embeddings": 32768},
      "tokenizer_config.json": {"model_max_length": 16384}},
     (16384, "model_max_length=16384 of tokenizer_config.json")),
    ({"config.json": {"max_position_embeddings": 32768,
                      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}},
     (131072, "max_position_embeddings=32768 x RoPE factor 4.0")),
    ({"config.json": {"max_position_embeddings": 131072,
                      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
     (131072, "max_position_embeddings=131072")),
    ({"config.json": {"hidden_size": 8}}, None),
    ({}, None),
])
def test_the_context_a_model_allows_is_read_as_vllm_reads_it(
        tmp_path: Path, files: dict[str, Any], want: tuple[int, str] | None) -> None:
    for name, body in files.items():
        (tmp_path / name).write_text(json.dumps(body))
    assert loading.derived_max_model_len(tmp_path) == want


def test_config_check_passes_the_repository_file() -> None:
    r = run_check(str(REPO_CONFIG))
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"{REPO_CONFIG}: ok: 1 model(s) ({MODEL}), 1 key(s), global limits "
                        "off, sampled access log on\n")


def test_config_check_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    r = run_check(str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "nope.yaml" in r.stderr


BIN = Path(sys.executable).parent
# Every reader of tokengate.yaml, the way an operator runs it, with the configuration's
# argument placed by {}: (command line, exit status, the prefix of its error line).
READERS = [
    (["tokengate", "config", "check", "{}"], 2, "tokengate config check: "),
    (["tokengate", "config", "apply", "{}"], 2, "tokengate config check: "),
    (["tokengate", "doctor", "--config", "{}"], 2, "tokengate doctor: "),
    (["tokengate", "keys", "create", "k9", "--rpm", "1", "--tpm", "1", "--no-apply",
      "--config", "{}"], 2, "tokengate keys: "),
    (["tokengate", "keys", "list", "--config", "{}"], 2, "tokengate keys: "),
    (["tokengate", "usage", "--config", "{}"], 2, "tokengate usage: "),
    (["tokengate-counter", "--config", "{}"], 1, "tokengate-counter: "),
    (["tokengate-ledger", "--config", "{}"], 2, "tokengate-ledger: "),
    (["tokengate-limits", "--config", "{}"], 2, "tokengate-limits: "),
    (["tokengate-console", "--config", "{}"], 2, "tokengate-console: "),
]


@pytest.mark.parametrize("argv,status,prefix", READERS,
                         ids=[" ".join(w for w in a[:3] if w[0] not in "-{")
                              for a, _, _ in READERS])
def test_a_configuration_that_is_not_utf8_is_refused_in_one_line(
        tmp_path: Path, argv: list[str], status: int, prefix: str) -> None:
    # a comment saved as Latin-1 (0xe9 is é); 300 random bytes failed the same way, with
    # a UnicodeDecodeError traceback from each of these and exit status 1
    path = tmp_path / "b9.yaml"
    path.write_bytes(b"models: {}\n# caf\xe9\n")
    r = subprocess.run([str(BIN / argv[0]), *(a.format(path) for a in argv[1:])],
                       capture_output=True, text=True, timeout=120, check=False)
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == (status, "", [
        (f"{prefix}{path}: not UTF-8 text: byte 0xe9 at offset 16 (invalid continuation "
         "byte); tokengate.yaml must be UTF-8")])
    with pytest.raises(tg_config.NotText, match=r"^.*b9\.yaml: not UTF-8 text: byte 0xe9 "):
        tg_config.load(path)


def _objects(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "properties" in node:
            yield node
        for v in node.values():
            yield from _objects(v)
    elif isinstance(node, list):
        for v in node:
            yield from _objects(v)


def test_the_json_schema_is_valid_and_closed(repo_raw: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    r = subprocess.run([str(TOKENGATE), "config", "schema"], capture_output=True, text=True,
                       timeout=60, check=True)
    schema = json.loads(r.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    objects = list(_objects(schema))
    # the file and every section: each schema model (a subclass of _Schema) appears once
    def descendants(cls: type) -> list[type]:
        return [d for c in cls.__subclasses__() for d in (c, *descendants(c))]

    assert len(objects) == len(descendants(tg_config._Schema))
    assert all(o["additionalProperties"] is False for o in objects)
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors(repo_raw)) == []
    raw = copy.deepcopy(repo_raw)
    put(f"models.{MODEL}.max_token_cap", 100)(raw)
    [err] = validator.iter_errors(raw)
    assert list(err.absolute_path) == ["models", MODEL]
    assert "max_token_cap" in err.message


def test_docs_config_md_is_generated_from_the_schema() -> None:
    assert DOCS.read_text() == config_docs.render(), \
        "run: tokengate config docs --out docs/config.md"


def test_docs_list_every_key() -> None:
    text = DOCS.read_text()
    for model in (tg_config.ModelConfig, tg_config.KeyConfig, tg_config.EdgeConfig,
                  tg_config.StructuredOutputLimits, tg_config.AccessLogConfig,
                  tg_config.Config):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, name


def test_docs_list_the_fields_of_a_keys_budgets() -> None:
    """A list of sections (keys.<id>.budgets) was shown as "list of section" without
    its fields."""
    text = DOCS.read_text()
    title = "## `keys.<key id>.budgets[]`\n"
    assert "| `budgets` | list of section: [`keys.<key id>.budgets[]`](#keyskey-idbudgets) |" \
        in text
    section = text[text.index(title):].split("\n## ", 1)[0]
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")] \
        == [f"| `{name}`" for name in tg_config.Budget.model_fields] \
        == ["| `period`", "| `spend`", "| `tokens`", "| `model`", "| `alerts`"]


def lua_load(doc: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """What lua/tokengate/config.lua's load() makes of ``doc``: {"err"} or a few fields."""
    path = tmp_path / "edge.json"
    path.write_text(json.dumps(doc))
    return json.loads(run_lua(f"""
        local cjson = require "cjson"
        local d, err = require("tokengate.config").load("{path}")
        if not d then return cjson.encode({{err = err}}) end
        local m = d.models["{MODEL}"]
        return cjson.encode({{name = m.name, cap = m.max_tokens_cap,
            default = m.default_max_tokens == nil, max_n = m.max_n,
            user_checked = m.special_token_roles.user == true,
            system_checked = m.special_token_roles.system == true,
            user_tokens = #m.role_tokens.user, assistant_tokens = #m.role_tokens.assistant,
            system_tokens = m.role_tokens.system == nil, all_tokens = #m.all_tokens,
            anchor = m.all_tokens.anchor,
            kwargs = d.edge.template_kwargs_allowed.enable_thinking == true,
            key = d.keys["{DEMO}"].id, backoff = d.edge.counter_backoff_ms,
            rate = require("tokengate.config").rules().rate}})"""))


def test_the_edge_loads_the_compiled_document_as_written(config_path: Path,
                                                         tmp_path: Path) -> None:
    doc = compile_config.compile_config(tg_config.load(config_path))
    assert lua_load(doc, tmp_path) == {
        "name": MODEL, "cap": 4096, "default": True, "max_n": 8, "user_checked": True,
        "system_checked": False, "key": "demo", "backoff": 500, "rate": 0.01,
        # 14 special tokens (user, assistant, tool, function) + 6 structural (user, tool,
        # function); none for system
        "user_tokens": 20, "assistant_tokens": 14, "system_tokens": True, "all_tokens": 20,
        "anchor": "<", "kwargs": True}


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(version=0), "version 0, expected 14: compile it again"),
    (lambda d: d.pop("access_log"), "no access_log section: compile it again"),
    (lambda d: d.pop("global_limits"), "no global_limits section: compile it again"),
])
def test_the_edge_refuses_a_stale_compiled_document(config_path: Path, tmp_path: Path,
                                                     edit: Callable[[dict[str, Any]], Any],
                                                     message: str) -> None:
    doc = compile_config.compile_config(tg_config.load(config_path))
    edit(doc)
    err = lua_load(doc, tmp_path)["err"]
    assert err.startswith(f"tokengate config: {tmp_path / 'edge.json'}: {message}")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_the_edge_refuses_a_compiled_document_with_a_number_that_is_not_finite(
        config_path: Path, tmp_path: Path, value: float) -> None:
    """compile_config writes no Infinity or NaN (json allow_nan=False), and the edge's
    loader refuses one in a file written otherwise: cjson reads them as numbers, and an
    infinite price had reached the budgets' counters (NaN there) and pb.lua (a 500)."""
    doc = compile_config.compile_config(tg_config.load(config_path))
    doc["models"][MODEL]["cost"]["input"] = value
    with pytest.raises(ValueError):
        json.dumps(doc, allow_nan=False)
    err = lua_load(doc, tmp_path)["err"]
    assert err == (f"tokengate config: {tmp_path / 'edge.json'}: models.{MODEL}.cost.input "
                   "is not a finite number: compile it again (tokengate config check names "
                   "what the schema refuses)")


def test_dns_servers_come_from_the_setting_else_resolv_conf(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# comment\nsearch example\nnameserver 10.0.0.2\nnameserver ::1\n")
    assert compile_config.dns_servers([], conf) == [["10.0.0.2", 53], ["::1", 53]]
    assert compile_config.dns_servers(["127.0.0.1:5353", "[::1]:53"], conf) == \
        [["127.0.0.1", 5353], ["::1", 53]]
    assert compile_config.dns_servers([], tmp_path / "missing") == []


def test_the_reference_writes_out_every_default_that_is_not_a_section() -> None:
    # "see section" is for a key whose default is a section of its own; a list's default
    # (ledger.engine_usage_files: []) is written out
    vague = [line.split(" | ")[0] for line in config_docs.render().splitlines()
             if "| see section |" in line and "| section: [" not in line
             and "| map: [" not in line]
    assert vague == []


def test_the_cli_called_in_process_leaves_sigpipe_to_python(tmp_path: Path) -> None:
    """cli.main([...]) from a Python process (a test, a script) keeps Python's SIGPIPE
    handling: with SIGPIPE's default action that process dies on its next write to a
    closed socket (a whole pytest run ended so, mid-test, with make's "Broken pipe")."""
    import signal

    from tokengate import cli

    path = tmp_path / "tokengate.yaml"
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    raw["models"][MODEL]["dir"] = str(REPO_CONFIG.parent / "var/models/tiny-qwen3")
    path.write_text(yaml.safe_dump(raw))
    before = signal.getsignal(signal.SIGPIPE)
    with pytest.raises(SystemExit) as done:
        cli.main(["config", "check", str(path)])
    assert (done.value.code, signal.getsignal(signal.SIGPIPE)) == (0, before)
    assert before == signal.SIG_IGN


@pytest.mark.parametrize("argv", [
    ["tokengate", "doctor"], ["tokengate", "usage"], ["tokengate", "keys", "create"],
    ["tokengate", "config", "check"], ["tokengate-counter"], ["tokengate-ledger"],
    ["tokengate-limits"], ["tokengate-console"]], ids=" ".join)
def test_every_commands_help_names_the_lookup_it_makes(argv: list[str]) -> None:
    # one text (config.LOOKUP_HELP), in discover()'s order: an installed file comes
    # before a checkout's ./tokengate.yaml
    out = subprocess.run([str(BIN / argv[0]), *argv[1:], "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert tg_config.LOOKUP_HELP in " ".join(out.split()), out
