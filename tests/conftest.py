"""Session fixtures: the real processes of the stack, started with devstack's builders.

Ports are offset from ``make run``'s (vLLM 18000, counter 15051, Redis 16380, nginx 18080)
so a running ``make run`` does not disturb the tests. Area-specific fixtures live in
``tests/fixtures_*.py`` modules registered below.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import yaml
from tokengate import config as tg_config
from tokengate.v1 import counter_pb2, counter_pb2_grpc
from tokengate_dev import devstack

if TYPE_CHECKING:
    from tokengate.counter.counting import BadRequest, CountResult, ModelCounter


def _share_ssl_contexts() -> None:
    """One SSL context per set of arguments for this process's HTTP clients.

    Each ``httpx.get``/``post``, ``openai.OpenAI`` and ``anthropic.Anthropic`` builds a
    client whose transport builds an SSL context, which parses the whole CA bundle (16 to
    20 ms of CPU) although the suite speaks plain HTTP on loopback: a profile of the
    workers found a third of their CPU there. A context is safe to share between clients
    and threads, so the suite's clients share one; what they send is unchanged."""
    import httpx._transports.default as httpx_transport

    modules = [httpx_transport]
    try:
        import httpx2._transports.default as httpx2_transport  # the openai client's
        modules.append(httpx2_transport)
    except ImportError:
        pass
    for module in modules:
        module.create_ssl_context = functools.cache(module.create_ssl_context)


_share_ssl_contexts()

pytest_plugins: list[str] = []
pytest_plugins.append("tests.fixtures_ledger")
pytest_plugins.append("tests.fixtures_storm")
pytest_plugins.append("tests.fixtures_edge")
pytest_plugins.append("tests.fixtures_vllm")
pytest_plugins.append("tests.fixtures_embeddings")
pytest_plugins.append("tests.fixtures_agents")
pytest_plugins.append("tests.fixtures_batch")

# TOKENGATE_TEST_PORT_OFFSET lets two test sessions run side by side; each pytest-xdist
# worker of a session (gw0, gw1, ...: make test runs two) adds 500 per worker, so its
# processes, ports and folder (TEST_DIR) are its own.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
PORT_OFFSET = int(os.environ.get("TOKENGATE_TEST_PORT_OFFSET", "0")) + 500 * WORKER
VLLM_PORT = 18000 + PORT_OFFSET
COUNTER_PORT = 15051 + PORT_OFFSET
# the KV-event publisher of the session's vLLM (vLLM servers on other ports publish none:
# devstack.kv_events_endpoint). 120 above it: no fixed port of another xdist worker
# (offsets 500 apart; tests/test_conftest.py checks them all)
KV_EVENTS = f"127.0.0.1:{VLLM_PORT + 120}"
# when this test run began (epoch s): the controller's import sets it, xdist's workers
# inherit it, so files older than it (logs of earlier runs in var/) are told from this run's
RUN_STARTED = float(os.environ.setdefault("TOKENGATE_TEST_RUN_STARTED", str(time.time())))
MODEL = "tiny-qwen3"
NO_REDIS = "redis://127.0.0.1:1/0"  # a Redis URL nothing answers (connection refused)
TEST_MAX_MODEL_LEN = 8192  # tokens: config_path's max_model_len (make run's is 65,536)
TEST_DIR = devstack.VAR / f"test{PORT_OFFSET or ''}"
# The checkout's own file: the package no longer knows where a checkout is.
REPO_CONFIG = Path(__file__).resolve().parents[1] / "tokengate.yaml"


def suite_model() -> tg_config.ModelConfig:
    """The repository's model with the suite's context (``TEST_MAX_MODEL_LEN``), as
    ``config_path`` configures it: for the tests that load a counter in-process."""
    model = tg_config.load(REPO_CONFIG).models[MODEL]
    return model.model_copy(update={"max_model_len": TEST_MAX_MODEL_LEN})


# the embedded model's tokenizer, as vLLM and the counter read it
MODEL_TOKENIZER = REPO_CONFIG.parent / "var/models/tiny-qwen3/tokenizer.json"


@functools.cache
def model_tokenizer_json() -> dict[str, Any]:
    """``MODEL_TOKENIZER`` parsed (11 MB of JSON: read once, when a test first asks, not
    when a worker collects the module). Read-only: every caller shares it."""
    return dict(json.loads(MODEL_TOKENIZER.read_text()))


@functools.cache
def added_tokens() -> dict[int, str]:
    """The embedded model's added tokens (special or not): id -> content."""
    return {t["id"]: t["content"] for t in model_tokenizer_json()["added_tokens"]}


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# The modules that import vLLM into the test process (its request classes, its KV-event
# and hashing code as references): 12-25 CPU-s and ~600 MB per process that imports it,
# so they form one xdist group, and one worker pays it.
VLLM_IN_PROCESS = pytest.mark.xdist_group("vllm-in-process")


def xdist_group(config: pytest.Config, item: pytest.Item, name: str) -> None:
    """Put ``item`` in the pytest-xdist group ``name`` (``--dist loadgroup``: a group's
    tests all run on one worker). xdist 3.8 groups by the suffix ``@name`` it adds to
    ``item._nodeid`` from the ``xdist_group`` mark, which pytest 9.2 no longer reads
    (``Node.nodeid`` is built from ``Node._id``): its groups were silently spread over
    the workers, and each worker booted the vLLM servers. This sets the suffix where
    pytest 9.2 reads it (``requirements.txt`` pins both)."""
    from _pytest.nodeid import NodeId

    item.add_marker(pytest.mark.xdist_group(name))
    if config.getoption("loadgroup", False) and not item.nodeid.endswith(f"@{name}"):
        item._id = NodeId.parse(f"{item.nodeid}@{name}")  # type: ignore[attr-defined]


# The session's vLLM servers other than the default one (tests/fixtures_vllm.py), by the
# fixture that asks for each: a test that needs one of them and not the default server
# runs in a group of that server's (below)
OTHER_VLLM = {"queue_vllm": "vllm-queue", "pooling_vllm": "vllm-pooling",
              "kv_vllm": "vllm-kv", "agents_stack": "vllm-agents",
              "spare_vllm": "vllm-spare"}


def vllm_group(fixtures: Iterable[str]) -> str | None:
    """The xdist group of a test with these fixtures in its closure: None without
    ``vllm_server``; ``vllm`` (the default server's) when it reaches the default server
    (``vllm_url``) or none of ``OTHER_VLLM``'s fixtures (it calls ``vllm_server()``
    itself) or more than one; else the group of the one other server it needs."""
    fixtures = set(fixtures)
    if "vllm_server" not in fixtures:
        return None
    others = {OTHER_VLLM[f] for f in fixtures & OTHER_VLLM.keys()}
    return others.pop() if len(others) == 1 and "vllm_url" not in fixtures else "vllm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``vllm`` every test whose fixture closure holds ``vllm_server`` (directly or
    through ``vllm_url``, ``edge``, ``edge_variant``, ...): ``make test-fast`` deselects
    them, so no vLLM server is started. Under ``make test`` each vLLM server boots on one
    worker only (60-90 s each on 2 cores, 2-3 GB each): the tests of the default server
    form the xdist group ``vllm``, and those of another server that the default
    server's tests never ask for (the pooling server, the KV-event one, the agents', the
    queue server) a group of that server's (``vllm_group``), which another worker runs
    meanwhile.

    Every other test is grouped by its module (a module marked ``xdist_group(name)``
    by that name): a module's tests run on one worker, in order, so its module-scoped
    fixtures (a ``make run`` stack, an installed tree, a fresh virtualenv) start once,
    where tests spread one by one over the workers started them on each."""
    groups = {item: vllm_group(getattr(item, "fixturenames", ())) for item in items}
    # a server that a test of the default server's group asks for boots there: its
    # other tests join that group (a server is never booted by two workers)
    in_main = {OTHER_VLLM[f] for item, g in groups.items() if g == "vllm"
               for f in set(getattr(item, "fixturenames", ())) & OTHER_VLLM.keys()}
    for item, group in groups.items():
        if group is not None:
            item.add_marker(pytest.mark.vllm)
            xdist_group(config, item, "vllm" if group in in_main else group)
        elif (mark := item.get_closest_marker("xdist_group")) is not None:
            xdist_group(config, item, mark.args[0])
        else:
            # e.g. deploy/test_keys (the suffix every test id of the module gets)
            module = item.nodeid.split("::")[0].removeprefix("tests/").removesuffix(".py")
            xdist_group(config, item, module)
    if config.getoption("loadgroup", False):
        items[:] = sorted(items, key=functools.partial(_group_rank, _group_sizes(items)))
    LAST_OF_GROUP.clear()
    LAST_OF_GROUP.update({_group_of(item): item for item in items})


# each group's last test in the session's order: a vLLM group's servers stop after it
LAST_OF_GROUP: dict[str, pytest.Item] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Name the group whose test may boot a vLLM server now (before its fixtures)."""
    from tests import fixtures_vllm

    fixtures_vllm.BOOTING_GROUP[0] = _group_of(item)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """After a group's last test (and its fixtures' teardown), stop the vLLM servers its
    tests booted: no later test asks for them (``vllm_group``); under xdist the worker
    knows its next test before it runs this one, and a group's tests run together."""
    from tests import fixtures_vllm

    group = _group_of(item)
    if LAST_OF_GROUP.get(group) is item:
        fixtures_vllm.stop_servers(group)


def _group_of(item: pytest.Item) -> str:
    return str(item.get_closest_marker("xdist_group").args[0])  # type: ignore[union-attr]


def _group_sizes(items: list[pytest.Item]) -> dict[str, tuple[bool, int]]:
    """group -> (holds a ``slow`` test, its number of tests)."""
    sizes: dict[str, tuple[bool, int]] = {}
    for item in items:
        slow, n = sizes.get(_group_of(item), (False, 0))
        sizes[_group_of(item)] = (slow or item.get_closest_marker("slow") is not None, n + 1)
    return sizes


def _group_rank(sizes: dict[str, tuple[bool, int]], item: pytest.Item) -> tuple[int, int]:
    """Where ``item``'s group comes in the order the workers take the groups (the Makefile
    keeps it: --no-loadscope-reorder): the longest first, so that none starts last and
    runs on alone. The vLLM groups (each boots a server), then the groups holding a
    ``slow`` test, then the others, each by its number of tests; a sort by this keeps
    the tests of a group in their order."""
    group = _group_of(item)
    slow, n = sizes[group]
    return (0 if group.startswith("vllm") else 1 if slow else 2,
            -1_000_000 if group == "vllm" else -n)


@pytest.fixture(scope="session")
def config_path() -> Path:
    """tokengate.yaml for tests: the repository's models pointed at the test ports."""
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    # never make run's Redis (6380): a `tokengate keys` command of a test would write its
    # audit entry into a running demo's stream. Nothing listens here, as on 6380 in CI;
    # a test that needs Redis passes the session's (redis_url) or its own.
    raw["redis"]["url"] = NO_REDIS
    for m in raw["models"].values():
        m["dir"] = str((REPO_CONFIG.parent / m["dir"]).resolve())
        # The suite's context: the limit tests send inputs just above it, and a short one
        # keeps them quick. make run serves the model's 65,536 tokens; the coding agents'
        # tests serve that on a stack of their own (tests/fixtures_agents.py).
        m["max_model_len"] = TEST_MAX_MODEL_LEN
        m["upstreams"] = [f"127.0.0.1:{VLLM_PORT}"]
        if m.get("routing", {}).get("kv_events"):
            # the session's vLLM publishes its KV events there (devstack.vllm_service)
            m["routing"]["kv_events"] = {f"127.0.0.1:{VLLM_PORT}": f"tcp://{KV_EVENTS}"}
    # many sidecars run at once in a session (and beside make run): a test that reads a
    # sidecar's metrics gives it a port of its own
    raw["metrics"] = {"counter_listen": None, "ledger_listen": None, "limits_listen": None}
    # and the console (the demo admin's) is off: tests/console gives its ledger one
    raw["ledger"].pop("console", None)
    TEST_DIR.mkdir(parents=True, exist_ok=True)
    path = TEST_DIR / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def cfg(config_path: Path) -> tg_config.Config:
    return tg_config.load(config_path)


@pytest.fixture(scope="session")
def counter_addr(config_path: Path) -> Iterator[str]:
    """host:port of a real tokengate-counter with two worker processes."""
    sock = TEST_DIR / "counter.sock"
    svc = devstack.counter_service(config_path, port=COUNTER_PORT, unix_socket=sock,
                                   workers=2, name=f"test-counter{PORT_OFFSET or ''}").start()
    try:
        yield f"127.0.0.1:{COUNTER_PORT}"
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def counter_stub(counter_addr: str) -> Iterator[counter_pb2_grpc.TokenCounterStub]:
    """A gRPC client of the session's counter (CountTokens)."""
    with grpc.insecure_channel(counter_addr) as channel:
        yield counter_pb2_grpc.TokenCounterStub(channel)


def read_until_closed(sock: socket.socket) -> bytes:
    """Every byte the peer sends on ``sock`` until it closes the connection (raw HTTP
    answers, counter frames)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def count_refusal(counter: ModelCounter, endpoint: str, body: dict[str, Any]) -> BadRequest:
    """The refusal of ``body`` by ``counter.count(endpoint, body)``, which must refuse it
    (the counter's unit tests' check of a message and the field it names). The counter
    is imported only here, when called: it loads transformers, which takes seconds."""
    from tokengate.counter.counting import BadRequest

    with pytest.raises(BadRequest) as info:
        counter.count(endpoint, body)
    return info.value


def count_as_chat(counter: ModelCounter, endpoint: str, body: dict[str, Any],
                  chat_body: dict[str, Any]) -> tuple[CountResult, CountResult]:
    """``counter.count(endpoint, body)`` and the count of ``chat_body`` (the chat body
    that ``body`` becomes), which must have the same prompt tokens and breakdown."""
    got, expected = counter.count(endpoint, body), counter.count("chat", chat_body)
    assert (got.prompt_tokens, got.breakdown) == (expected.prompt_tokens, expected.breakdown)
    return got, expected


def assert_cases_cover(cases: Sequence[tuple[Any, ...]], at_least: int,
                       named: Iterable[str] = ()) -> None:
    """A parity test's cases cover its contract: at least ``at_least`` of them, each
    name (a case's first item) once, and every name of ``named`` among them."""
    names = [c[0] for c in cases]
    assert len(cases) >= at_least
    assert len(set(names)) == len(cases)
    assert set(named) <= set(names)


def count_body(stub: counter_pb2_grpc.TokenCounterStub, endpoint: int,
               body: dict[str, Any]) -> counter_pb2.CountReply:
    """The counter's CountTokens of ``body`` (sent as JSON) for ``MODEL`` on ``endpoint``
    (a ``tokengate.v1.Endpoint``): the parity tests' call. Raises grpc.RpcError."""
    return stub.CountTokens(counter_pb2.CountRequest(
        model=MODEL, endpoint=endpoint, body=json.dumps(body).encode()))
