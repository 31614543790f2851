"""Start the whole tokengate stack on loopback: the commands ``make run`` and the tests use.
(Over 600 lines: one builder per part of the stack, for ``make run``, the benchmarks
and the tests alike, sharing the stack's paths, ports and readiness checks.)

Each part is a ``tokenstorm.process.Service``: an argv, an environment, a readiness probe
and a log file under ``var/log``. ``make run`` calls ``python -m tokengate_dev.devstack run``; the test
fixtures call the same builders (with other ports) so tests run exactly what a user runs.

Ports of ``make run`` (all loopback): vLLM 8000, counter gRPC 50051 (and, for the edge,
its workers' counter-frame sockets under var/run), Redis 6380, nginx 8080; with ``global_limits.enabled`` also the
global-limit sidecar on ``global_limits.listen`` (50061) and its unix socket; with an
admin in ``ledger.console.admins`` the operator console on ``ledger.console.listen``
(8085). All but the counter's come from the configuration (``--counter-port`` sets that
one), and
``--var DIR`` moves logs, sockets and rendered configurations out of the checkout's
``var/``: a second stack (a test of ``make run`` itself) runs beside the first.

``run`` supervises: a part that dies is stopped entirely (its workers too) and started
again after 1 s, 2 s, 4 s ... up to 30 s (back to 1 s once it stayed up a minute), each
restart said on the terminal, the other parts up meanwhile. SIGINT, SIGTERM or SIGHUP
at any moment, also while a part is still starting, stops everything.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import quote, urlsplit

from tokengate import config as tg_config
from tokenstorm.process import (
    Service,
    ServiceError,
    Supervisor,
    http_ready,
    tcp_ready,
    unix_ready,
)

# Dev tooling runs from a checkout: its folders are found from this file.
ROOT = Path(__file__).resolve().parents[2]
VAR = ROOT / "var"
NGINX_DIR = ROOT / "nginx"   # the edge's nginx templates
LUA_DIR = ROOT / "lua"       # the edge's Lua modules
PYTHON = sys.executable


def _service(name: str, argv: list[str], ready: Callable[[], bool],
             env: dict[str, str] | None = None, start_timeout_s: float = 60.0,
             prepare: Callable[[], None] | None = None) -> Service:
    """A process of the stack: run from the checkout, logging to ``var/log/<name>.log``;
    ready within ``start_timeout_s`` (60 s: a Python sidecar's start took over 30 s on a
    2-core host with the whole suite beside it)."""
    return Service(name, argv, ready, env or {}, start_timeout_s, cwd=ROOT, log_dir=VAR / "log",
                   prepare=prepare)


# vLLM's --block-size on its CPU build when none is given (vllm/platforms/cpu.py
# check_and_update_config; 16 on GPUs, prefix_hash.DEFAULT_BLOCK_SIZE)
CPU_BLOCK_SIZE = 128


def kv_events_endpoint(model: tg_config.ModelConfig, port: int) -> str | None:
    """The ``routing.kv_events`` endpoint of the model's loopback upstream on ``port``
    when the model is routed by the prefix cache (None otherwise: a server on another
    port, the tests' other vLLM servers, publishes nothing)."""
    for upstream, endpoint in model.kv_events.items():
        if tg_config._is_loopback(upstream) and upstream.rpartition(":")[2] == str(port):
            return endpoint
    return None


def kv_events_bind(endpoint: str) -> str:
    """What vLLM's ``--kv-events-config`` endpoint must say for its publisher to listen
    on ``endpoint`` (``tcp://host:port``, what the counter connects to). vLLM binds only
    an endpoint holding ``*`` or ``::`` and connects to any other
    (``ZmqEventPublisher._is_bind_endpoint``): an IPv4 host is given in its IPv4-mapped
    form, ``tcp://[::ffff:127.0.0.1]:5557``, which ZMQ binds to 127.0.0.1 alone (``*``
    would listen on every interface, publishing prompts' token ids there); any other host
    as ``*``."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = "127.0.0.1" if host == "localhost" else host.strip("[]")
    try:
        mapped = isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        mapped = False
    return f"tcp://[::ffff:{host}]:{port}" if mapped else f"tcp://*:{port}"


# the tokengate vLLM plugin's middleware: the edge's key and endpoint of each request in its
# engine record (tokengate_vllm.edge), so a record whose usage event never came is billed
EDGE_MIDDLEWARE = "tokengate_vllm.edge.EdgeHeaders"


def vllm_service(model: tg_config.ModelConfig, port: int = 8000,
                 name: str = "vllm", engine_usage_file: Path | None = None,
                 tracing: tg_config.TracingConfig | None = None) -> Service:
    """vLLM's OpenAI server (CPU build) on the model directory, served under its name,
    with ``--runner pooling`` for a pooling (embedding) model.

    Started as a module (the ``vllm`` console script of the CPU build looks for a
    distribution named ``vllm`` and fails). ``-O0``: no torch.compile. The CPU build
    otherwise traces and compiles the model at every start (its AOT cache fails to load:
    "Compiling model again due to a load failure ... 'function' object has no attribute
    'finalize_loading'"), 30 s idle and over 100 s on a busy 2-core machine, for no
    speed the tiny model shows (300 completion tokens take the same time either way).
    Startup then takes 30-70 s on 2 cores. The model runs in the engine core process
    (``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
    vllm/platforms/cpu.py turns ``uni`` into ``mp`` unless that variable is 0): one
    spawned process fewer, each of which imports vLLM and torch again, so a start takes
    18 s instead of 26 s on an idle machine, the same tokens. The
    tokengate plugin writes its engine usage records to ``engine_usage_file`` (default
    ``var/usage/engine.jsonl``): given explicitly, so that a test's vLLM never writes
    into ``make run``'s file; its middleware (``EDGE_MIDDLEWARE``) puts the edge's key
    and endpoint of each request into them.

    A model routed by the prefix cache (``routing.policy: prefix``) gets the replica
    settings its routing names: ``--kv-events-config`` publishing on its
    ``routing.kv_events`` endpoint for this port (``kv_events_endpoint``, bound as
    ``kv_events_bind`` says), and ``--block-size``, ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED`` where
    ``routing`` differs from the CPU build's defaults (128, sha256, none).

    With ``tracing`` (enabled), vLLM exports its own request spans to the same collector
    (``--otlp-traces-endpoint``; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL and _HEADERS from
    the section), children of the edge's upstream span through the `traceparent` the
    edge sends (vllm/tracing/otel.py).
    """
    argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model.dir), "--served-model-name", model.name,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(model.max_model_len),
            "--enable-prompt-tokens-details",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--disable-uvicorn-access-log", "-O0", "--distributed-executor-backend", "uni",
            "--middleware", EDGE_MIDDLEWARE]
    if model.runner == "pooling":
        # an embedding model (models.<name>.runner): vLLM serves /v1/embeddings only
        argv += ["--runner", "pooling"]
    routing, routing_env = model.routing, {}
    if routing.policy == "prefix":
        endpoint = kv_events_endpoint(model, port)
        if endpoint is not None:
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": kv_events_bind(endpoint)})]
        if routing.block_size != CPU_BLOCK_SIZE:
            argv += ["--block-size", str(routing.block_size)]
        if routing.hash_algo != "sha256":
            argv += ["--prefix-caching-hash-algo", routing.hash_algo]
        if routing.hash_seed is not None:
            routing_env["PYTHONHASHSEED"] = routing.hash_seed
    if tracing is not None and tracing.enabled:
        from tokengate.ledger.tracing import collector_url

        argv += ["--otlp-traces-endpoint", collector_url(tracing)]
        routing_env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = tracing.protocol
        if tracing.headers:
            routing_env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = ",".join(
                f"{k}={quote(v)}" for k, v in tracing.headers.items())
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           # stored responses (GET /v1/responses/{id}, previous_response_id), kept in
           # the replica's memory (tokengate.responses routes to it)
           "VLLM_ENABLE_RESPONSES_API_STORE": "1",
           # KV events, where a server publishes them, carry whole 32-byte block hashes
           # (vLLM's default is their low 64 bits as integers; the counter reads both)
           "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
           "TOKENGATE_ENGINE_USAGE_FILE": str(engine_usage_file or VAR / "usage" / "engine.jsonl"),
           **routing_env}
    # vLLM's ZMQ IPC sockets (3 a start) go to VLLM_RPC_BASE_PATH, by default the
    # temporary folder, and stay there after the server stops (vllm/utils/
    # network_utils.py get_open_zmq_ipc_path); one short folder per port (a socket's
    # path is at most 107 bytes) emptied before each start keeps no more than one
    # start's (the installed unit has PrivateTmp=yes)
    rpc_dir = Path(tempfile.gettempdir()) / f"tokengate-vllm-{port}"
    env["VLLM_RPC_BASE_PATH"] = str(rpc_dir)

    def prepare() -> None:
        shutil.rmtree(rpc_dir, ignore_errors=True)
        rpc_dir.mkdir(mode=0o700)

    return _service(name, argv, http_ready(f"http://127.0.0.1:{port}/health"), env,
                    start_timeout_s=400.0, prepare=prepare)


def _metrics_args(metrics_listen: str | None) -> list[str]:
    """``--metrics-listen`` of a sidecar: host:port or "none"; None: the configuration's
    ``metrics.*_listen``."""
    return [] if metrics_listen is None else ["--metrics-listen", metrics_listen]


def counter_service(config_path: Path, port: int = 50051, unix_socket: Path | None = None,
                    workers: int = 2, name: str = "counter",
                    metrics_listen: str | None = None) -> Service:
    """The token counter sidecar (``tokengate-counter``): gRPC on TCP and, with
    ``unix_socket``, counter frames on its workers' ``<unix_socket>.<i>``; its Prometheus
    metrics on ``metrics_listen`` (default ``metrics.counter_listen``)."""
    argv = [PYTHON, "-m", "tokengate.counter.server", "--config", str(config_path),
            "--port", str(port), "--workers", str(workers), *_metrics_args(metrics_listen)]
    ready = tcp_ready("127.0.0.1", port)
    if unix_socket is not None:
        argv += ["--unix-socket", str(unix_socket)]
        from tokengate.tools.nginx_conf import counter_sockets

        sockets = counter_sockets(unix_socket, workers)
        port_ready = ready

        def ready() -> bool:
            # every worker publishes its socket once its models are loaded; the shared
            # TCP port answers as soon as the first one listens
            return port_ready() and all(s.is_socket() for s in sockets)
    return _service(name, argv, ready)


def redis_service(port: int = 6380, name: str = "redis", persist: bool = False,
                  data_dir: Path | None = None) -> Service:
    """redis-server on loopback. ``persist``: an append-only file in ``data_dir``
    (default ``var/redis``; fsync every second), as ``make run`` uses it: the budgets'
    counters live only in Redis (the ledger's counters are rebuilt from the usage files
    when Redis lost them; the budgets' are not), so they survive a restart of the stack.
    Without it (the tests), nothing is written to disk."""
    data = data_dir or VAR / ("redis" if persist else "run")
    data.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if persist else "no", "--appendfsync", "everysec",
            "--dir", str(data)]
    return _service(name, argv, tcp_ready("127.0.0.1", port), start_timeout_s=20.0)


def ledger_service(config_path: Path, usage_file: Path | None = None,
                   redis_url: str | None = None, ledger_id: str | None = None,
                   name: str = "ledger", engine_files: Sequence[Path] = (),
                   metrics_listen: str | None = None) -> Service:
    """The usage ledger (``tokengate-ledger``): tails the usage file into Redis, and the
    vLLM plugin's ``engine_files`` when given (``--engine-file``; else those of
    ``ledger.engine_usage_files``), whose records then settle the bill. Its Prometheus
    metrics on ``metrics_listen`` (default ``metrics.ledger_listen``).

    Ready once it wrote its status file (``var/run/<name>.status.json``, refreshed every
    second: applied, lag_bytes, redis_up, ...); one left by an earlier ledger is
    removed before each start.
    """
    status = VAR / "run" / f"{name}.status.json"
    status.parent.mkdir(parents=True, exist_ok=True)
    argv = [PYTHON, "-m", "tokengate.ledger.service", "--config", str(config_path),
            "--status-file", str(status), *_metrics_args(metrics_listen)]
    if usage_file is not None:
        argv += ["--usage-file", str(usage_file)]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    if ledger_id is not None:
        argv += ["--ledger-id", ledger_id]
    for f in engine_files:
        argv += ["--engine-file", str(f)]
    # the status file is the probe: the one a previous ledger wrote must not count
    return _service(name, argv, status.exists,
                    prepare=lambda: status.unlink(missing_ok=True))


def console_service(config_path: Path, usage_file: Path | None = None,
                    redis_url: str | None = None, listen: str | None = None,
                    name: str = "console") -> Service:
    """The operator console (``tokengate-console``) on ``listen`` (default
    ``ledger.console.listen``), reading ``usage_file`` (default ``ledger.usage_file``)
    and its rotated siblings and the Redis of ``redis_url`` (default ``redis.url``).
    Ready once its login page answers 200."""
    argv = [PYTHON, "-m", "tokengate.console.service", "--config", str(config_path)]
    if listen is None:
        listen = tg_config.load(config_path).ledger.console.listen
    argv += ["--listen", listen]
    if usage_file is not None:
        argv += ["--usage-file", str(usage_file)]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    host, _, port = listen.rpartition(":")
    login = f"http://{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{port}/login"
    return _service(name, argv, http_ready(login))


# The demo secret of tokengate.yaml's batch section (batch.worker_sha256): make run
# writes it to batch.worker_secret_file when that file is missing
DEMO_BATCH_WORKER_KEY = "tg-demo-batch-worker"


def batch_service(config_path: Path, listen: str | None = None, redis_url: str | None = None,
                  edge_url: str | None = None, name: str = "batch") -> Service:
    """The Batch API (``tokengate-batch``) on ``listen`` (``host:port`` or
    ``unix:<path>``; default ``batch.unix_socket``, else ``batch.listen``),
    sending lines to ``edge_url`` (default ``batch.edge_url``), its state in the Redis of
    ``redis_url`` (default ``redis.url``). When ``batch.worker_secret_file`` is missing
    and ``batch.worker_sha256`` is the demo secret's, the file is written with it. Ready
    once its listener accepts connections."""
    cfg = tg_config.load(config_path)
    b = cfg.batch
    argv = [PYTHON, "-m", "tokengate.batch.service", "--config", str(config_path)]
    listen = listen or b.address
    argv += ["--listen", listen]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    if edge_url is not None:
        argv += ["--edge-url", edge_url]

    def prepare() -> None:
        if listen.startswith("unix:"):
            Path(listen.removeprefix("unix:")).parent.mkdir(parents=True, exist_ok=True)
        demo = hashlib.sha256(DEMO_BATCH_WORKER_KEY.encode()).hexdigest()
        if b.worker_sha256 == demo and not b.worker_secret_file.exists():
            b.worker_secret_file.parent.mkdir(parents=True, exist_ok=True)
            b.worker_secret_file.write_text(DEMO_BATCH_WORKER_KEY + "\n")
            b.worker_secret_file.chmod(0o600)

    if listen.startswith("unix:"):
        ready = unix_ready(listen.removeprefix("unix:"))
    else:
        host, _, port = listen.rpartition(":")
        ready = tcp_ready(host, int(port))
    return _service(name, argv, ready, prepare=prepare)


def limits_service(config_path: Path, port: int = 50061, redis_url: str | None = None,
                   unix_socket: Path | None = None, workers: int = 1,
                   name: str = "limits", metrics_listen: str | None = None) -> Service:
    """The global-limit sidecar (``tokengate-limits``): gRPC ``GlobalLimits`` on
    127.0.0.1:port (and worker i on ``<unix_socket>.<i>`` when given) in front of the
    Redis sliding windows shared by every edge; its Prometheus metrics on
    ``metrics_listen`` (default ``metrics.limits_listen``)."""
    argv = [PYTHON, "-m", "tokengate.limits.server", "--config", str(config_path),
            "--listen", f"127.0.0.1:{port}", "--workers", str(workers),
            "--unix-socket", str(unix_socket) if unix_socket is not None else "none",
            *_metrics_args(metrics_listen)]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    return _service(name, argv, tcp_ready("127.0.0.1", port))


def fast_upstream_service(port: int = 38100, model: str = "tiny-qwen3",
                          max_model_len: int = 8192, ttft_ms: float = 0.0, itl_ms: float = 0.0,
                          workers: int = 1, name: str = "fast-upstream") -> Service:
    """TokenStorm's fast upstream: nginx + Lua answering like vLLM 0.32 (``tokenstorm
    upstream``), with simulated TTFT and inter-token latency (ms); for gateway benchmarks
    and as the null server. Config rendered under ``var/run/<name>``."""
    from tokenstorm import null_server, upstream

    opts = upstream.UpstreamOptions(model=model, max_model_len=max_model_len, ttft_ms=ttft_ms,
                                    itl_ms=itl_ms, workers=workers)
    return null_server.upstream_service(opts, port, VAR, name)


def nginx_service(config_path: Path, port: int = 8080, counter_socket: Path | None = None,
                  counter_workers: int = 2, workers: int = 2, name: str = "nginx",
                  prefix: Path | None = None, limits_workers: int = 1,
                  status_port: int | None = None) -> Service:
    """The nginx + ngx_lua edge on 127.0.0.1:port (the gateway users call), its status
    server on 127.0.0.1:status_port (default: the configuration's edge.status_listen).

    Renders a complete instance (``tokengate.tools.nginx_conf``) into ``prefix``
    (default ``var/run/<name>``): nginx.conf, the http-level include, the compiled
    configuration (edge.json) and the loopback-hop socket. ``counter_socket`` is the
    counter's ``--unix-socket`` path (its workers listen on ``<path>.<i>``). With
    ``global_limits.enabled`` the edge also reserves in the global-limit sidecar
    (``global_limits.unix_socket``, ``limits_workers`` sockets). Raises ``ConfigError``
    for a bad configuration. Starts in well under a second.
    """
    from tokengate.tools import nginx_conf

    inst = nginx_conf.EdgeInstance(
        prefix=(prefix or VAR / "run" / name).resolve(), listen=f"127.0.0.1:{port}",
        counter_socket=(counter_socket or VAR / "run" / "counter.sock").resolve(),
        templates=NGINX_DIR, lua_dir=LUA_DIR, counter_workers=counter_workers, workers=workers, limits_workers=limits_workers,
        status_listen=None if status_port is None else f"127.0.0.1:{status_port}")
    conf = nginx_conf.write_instance(config_path, inst)
    argv = ["nginx", "-p", str(inst.prefix), "-c", str(conf), "-e", "stderr"]

    # a restart after a SIGKILL finds the master's hop socket still there (write_instance
    # removed it only for the first start)
    return _service(name, argv, tcp_ready("127.0.0.1", port), start_timeout_s=20.0,
                    prepare=inst.remove_stale_hop_socket)


DEMO_KEY = "tg-demo-key"


DEMO_ADMIN = ("admin", "tg-demo-admin")


def console_admin(cfg: tg_config.Config) -> tuple[str, str | None] | None:
    """The operator console's login that ``make run`` prints: (admin name, password or
    None when it is not known here), or None when the console is off (no admins). The
    repository's tokengate.yaml holds the demo admin (``DEMO_ADMIN``, like the demo key:
    for the loopback stack; ``tokengate console passwd admin`` sets another password).
    The file is never written here."""
    from tokengate.console import password

    admins = cfg.ledger.console.admins
    if not admins:
        return None
    name, secret = DEMO_ADMIN
    if name in admins and password.verify(secret, admins[name]):
        return name, secret
    return next(iter(admins)), None


def banner(base_url: str, model: str, usage_file: str = "var/usage/usage.jsonl",
           observe: Sequence[tuple[str, str]] = (), config: tg_config.Config | None = None,
           config_name: str = "tokengate.yaml",
           console: tuple[str, str, str | None] | None = None) -> str:
    """What ``make run`` prints once the stack is up: base URL, the demo key (when the
    configuration holds it; else the key placeholder), examples; ``observe``: (what,
    URL) lines of the health and metrics endpoints; ``console``: the operator console's
    (URL, admin, password or None)."""
    demo = config is None or any(k.sha256 == hashlib.sha256(DEMO_KEY.encode()).hexdigest()
                                 for k in config.keys.values())
    key = DEMO_KEY if demo else "$TOKENGATE_API_KEY"
    py_key = f'"{DEMO_KEY}"' if demo else '__import__("os").environ["TOKENGATE_API_KEY"]'
    said = f"demo key of {config_name}" if demo else \
        f"{config_name} has no demo key: use one of its keys (tokengate keys create)"
    tracing = config.tracing if config is not None else None
    traces = (f"traces go to {tracing.endpoint} ({tracing.protocol})" if tracing and tracing.enabled
              else "traces are off (tracing.enabled: docs/operators/observability.md)")
    block = "".join(f"  {what:<15}: {url}\n" for what, url in observe)
    if block:
        block = "\n  health and metrics (no key needed):\n" + block
    if console is not None:
        url, admin, secret = console
        pw = secret if secret is not None else \
            f"as set (tokengate console passwd {admin} sets a new one)"
        block += (f"\n  operator console (log in as an admin; an API key is no login):\n"
                  f"  console        : {url}\n  user           : {admin}\n"
                  f"  password       : {pw}\n")
    return f"""
tokengate is up.
  base URL : {base_url}
  API key  : {key}   ({said})
  model    : {model}
{block}
  curl {base_url}/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'

  .venv/bin/python -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}", \\
    api_key={py_key}); print(c.chat.completions.create(model="{model}", \\
    messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=16))'

Responses carry X-Token-Count and x-ratelimit-* headers; usage events go to
{usage_file}; {traces}. Ctrl-C stops everything."""


def sidecar_metrics(cfg: tg_config.Config) -> list[tuple[str, str, str]]:
    """(what, setting, host:port) of the /metrics port of each sidecar ``make run``
    starts (the limits sidecar only with global limits); ports set to none left out."""
    m = cfg.metrics
    out = [("counter metrics", "metrics.counter_listen", m.counter_listen),
           ("ledger metrics", "metrics.ledger_listen", m.ledger_listen),
           ("limits metrics", "metrics.limits_listen",
            m.limits_listen if cfg.global_limits.enabled else None)]
    return [(what, setting, addr) for what, setting, addr in out if addr is not None]


def endpoints(cfg: tg_config.Config, listen: str, status_listen: str) -> list[tuple[str, str]]:
    """(what, URL) of the stack's health and metrics endpoints: the edge's /healthz and
    /readyz (API listener), its /metrics (status server) and each sidecar's /metrics
    that ``make run`` starts."""
    return [("edge liveness", f"http://{listen}/healthz"),
            ("edge readiness", f"http://{listen}/readyz"),
            ("edge metrics", f"http://{status_listen}/metrics"),
            *((what, f"http://{addr}/metrics") for what, _, addr in sidecar_metrics(cfg))]


def stack(config_path: Path, counter_port: int = 50051) -> list[Service]:
    """The services ``make run`` starts, in start order: Redis (on the port of
    ``redis.url``), the counter (gRPC on ``counter_port``), the
    global-limit sidecar (only with ``global_limits.enabled``), the embedded vLLM of each
    model that says ``embedded: true`` (none when every model's upstreams are servers of
    their own), the nginx edge (rendered into ``var/run/nginx``), the usage ledger
    (which reads the embedded vLLM's engine usage records too) and, when
    ``ledger.console.admins`` names someone, the operator console; with
    ``batch.enabled``, the Batch API (``tokengate-batch``)."""
    cfg = tg_config.load(config_path)
    (VAR / "run").mkdir(parents=True, exist_ok=True)
    from tokengate.tools.compile_config import edge_config

    edge_port = int(edge_config(cfg).listen.rpartition(":")[2])
    services = [
        redis_service(port=urlsplit(cfg.redis.url).port or 6379, persist=True),
        counter_service(config_path, port=counter_port, unix_socket=VAR / "run" / "counter.sock"),
    ]
    gl = cfg.global_limits
    if gl.enabled:
        # before the edge: its first requests reserve there (the edge falls back to its
        # local limits, and says so, whenever the sidecar is not answering)
        services.append(limits_service(config_path, port=int(gl.listen.rpartition(":")[2]),
                                       unix_socket=gl.unix_socket))
    # the schema allows embedded only with one loopback upstream
    services += [vllm_service(m, port=int(m.upstreams[0].rpartition(":")[2]),
                              name="vllm" if len(cfg.models) == 1 else f"vllm-{name}",
                              tracing=cfg.tracing)
                 for name, m in cfg.models.items() if m.embedded]
    # the embedded vLLM's engine records (vllm_service's default file) settle the bill,
    # unless the configuration names the engine files itself
    engine = [VAR / "usage" / "engine.jsonl"] \
        if any(m.embedded for m in cfg.models.values()) and not cfg.ledger.engine_usage_files \
        else []
    services += [
        nginx_service(config_path, port=edge_port, counter_socket=VAR / "run" / "counter.sock"),
        ledger_service(config_path, engine_files=engine),
    ]
    if cfg.ledger.console.admins:
        services.append(console_service(config_path))
    if cfg.batch.enabled:
        services.append(batch_service(config_path))
    return services


def listeners(cfg: tg_config.Config, counter_port: int) -> list[tuple[str, str]]:
    """(setting, host:port) of every TCP address the stack that ``stack`` starts
    listens on."""
    from tokengate.tools.compile_config import edge_config

    edge = edge_config(cfg)
    redis_port = urlsplit(cfg.redis.url).port or 6379
    out = [("redis.url", f"127.0.0.1:{redis_port}"),
           ("the counter's gRPC port (make run COUNTER_PORT=N)",
            f"127.0.0.1:{counter_port}"),
           ("edge.listen", edge.listen), ("edge.status_listen", edge.status_listen)]
    if cfg.global_limits.enabled:
        out.append(("global_limits.listen", cfg.global_limits.listen))
    out += [(f"models.{name}.upstreams.0 (embedded vLLM)", m.upstreams[0])
            for name, m in cfg.models.items() if m.embedded]
    for name, m in cfg.models.items():
        endpoint = kv_events_endpoint(m, int(m.upstreams[0].rpartition(":")[2])) \
            if m.embedded else None
        if endpoint is not None:
            out.append((f"models.{name}.routing.kv_events (embedded vLLM's KV events)",
                        endpoint.removeprefix("tcp://")))
    if cfg.ledger.console.admins:
        out.append(("ledger.console.listen (the operator console)", cfg.ledger.console.listen))
    if cfg.batch.enabled and cfg.batch.unix_socket is None:
        out.append(("batch.listen (the Batch API)", cfg.batch.listen))
    return out + [(setting, addr) for _, setting, addr in sidecar_metrics(cfg)]


def busy(addresses: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (setting, host:port) of ``addresses`` that something already listens on."""
    out = []
    for setting, addr in addresses:
        host, _, port = addr.rpartition(":")
        if tcp_ready(host.strip("[]"), int(port))():
            out.append((setting, addr))
    return out


def _shown_path(path: Path) -> str:
    """``path`` relative to the checkout when it lies in it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def run(config_path: Path, counter_port: int = 50051) -> int:
    """Start every part (``stack``), print how to call the gateway, keep the parts up
    (``Supervisor``) until SIGINT/SIGTERM/SIGHUP, then stop all. Returns the exit
    status: 0, or 1 when a part failed its first start (its log's tail on stderr) or
    the configuration is invalid (one line per problem on stderr, nothing started)."""
    try:
        cfg = tg_config.load(config_path)
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(f"{_shown_path(config_path)}: {line}", file=sys.stderr)
        print("not started: fix the configuration (tokengate config check "
              f"{_shown_path(config_path)})", file=sys.stderr)
        return 1
    model = next(iter(cfg.models.values()))
    from tokengate.tools.compile_config import edge_config

    edge = edge_config(cfg)
    usage_file = os.path.relpath(edge.usage_file, ROOT)
    edge_port = int(edge.listen.rpartition(":")[2])
    taken = busy(listeners(cfg, counter_port))
    if taken:
        width = max(len(addr) for _, addr in taken)
        print("not started: these addresses are in use by other processes (another "
              "`make run`, of this checkout or another?):\n"
              + "".join(f"  {addr:<{width}}  {setting}\n" for setting, addr in taken)
              + "Stop them, or give this stack other ports: a copy of the configuration "
              "with those settings changed, then `make run CONFIG=<that file>`.",
              file=sys.stderr)
        return 1
    sup = Supervisor(stack(config_path, counter_port),
                     say=lambda line: print(line, flush=True))
    observe = endpoints(cfg, edge.listen, edge.status_listen)
    login = console_admin(cfg)
    console = (f"http://{cfg.ledger.console.listen}/", *login) if login else None

    def terminate(signum: int, frame: object) -> None:
        # a flag, not an exception: one raised inside Popen would lose the child
        if not sup.stopping():
            print("\nstopping ...", flush=True)
        sup.request_stop()

    # SIGINT also when started in the background; SIGHUP: the terminal went away
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, terminate)
    try:
        sup.run(on_up=lambda: print(banner(f"http://127.0.0.1:{edge_port}/v1", model.name,
                                           usage_file, observe, cfg,
                                           _shown_path(config_path), console), flush=True))
    except ServiceError as e:
        print(f"not started: {e}", file=sys.stderr)
        return 1
    print("stopped.", flush=True)
    return 0


def main() -> None:
    global VAR
    parser = argparse.ArgumentParser(prog="python -m tokengate_dev.devstack",
                                     description="Run the tokengate stack on loopback.")
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--config", type=Path, default=ROOT / "tokengate.yaml")
    parser.add_argument("--counter-port", type=int, default=50051,
                        help="the counter's gRPC port (default: %(default)s)")
    parser.add_argument("--var", type=Path, default=VAR,
                        help="folder of logs, sockets and rendered configurations "
                             "(default: the checkout's var/)")
    args = parser.parse_args()
    VAR = args.var.resolve()
    sys.exit(run(args.config, args.counter_port))


if __name__ == "__main__":
    main()
