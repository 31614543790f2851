"""tokengate-counter: the exact prompt-token counter, served over gRPC.

NAME
    tokengate-counter - count the prompt tokens of OpenAI-style request bodies exactly

SYNOPSIS
    tokengate-counter [--config FILE] [--host HOST] [--port PORT]
                      [--unix-socket PATH] [--workers N] [--threads T]
                      [--metrics-listen HOST:PORT]
                      [--check-upstreams [--allow-unverified-vllm] [--upstream-wait-s S]]

DESCRIPTION
    Serves tokengate.v1.TokenCounter/CountTokens (proto/tokengate/v1/counter.proto):
    over gRPC on HOST:PORT, with the standard gRPC health service (grpc.health.v1.Health)
    and server reflection, and as counter frames (tokengate.counter.frames: the same
    messages without HTTP/2, what the nginx edge speaks) on the unix sockets.
    Models come from the YAML configuration (models.<name>.dir: the served model's own
    directory, the same tokenizer.json and chat template vLLM loads).

    Python holds one GIL per process, so the counter runs N worker processes, forked
    once the parent has loaded the models (they share the parsed tokenizers). Every
    worker listens on HOST:PORT (SO_REUSEPORT: the kernel spreads connections) and, with
    --unix-socket PATH, on its own socket PATH.<i> (i = 0..N-1), which the nginx edge
    calls (mode 0660: the owner and the process's group, nginx's workers' group under
    the systemd unit). A worker answers its socket's calls one at a time, in one thread.
    --port 0 serves the unix sockets only. The parent restarts a worker that dies and stops all of
    them on SIGTERM/SIGINT.

    --metrics-listen (metrics.counter_listen) serves Prometheus /metrics: calls by
    model and gRPC code, their latency, prompt tokens counted and segment cache
    lookups by result, summed over the workers; for models routed by the prefix cache,
    each replica's KV-event index (blocks held, live, events applied, resets by reason).

    A model whose routing.policy is prefix gets with each count the prompt's KV-cache
    block hashes and, for each replica of its routing.kv_events, the prompt tokens that
    replica's prefix cache holds now: every worker follows those replicas' KV events
    (vLLM's --kv-events-config, ZMQ) in threads of its own
    (tokengate.counter.kv_index).

    SIGHUP (systemctl reload) reloads the configuration: each worker loads the models
    anew and swaps them in once loaded (max_model_len, max_tokens_cap, output
    reserve, a new tokenizer directory, models added or removed, routing settings and
    KV-event endpoints: a replica still listed keeps what its index learned); calls in flight
    finish with the models they started with, none is dropped. A file that does not
    load is logged and the worker keeps the previous models.

    --check-upstreams runs `tokengate doctor`'s checks on every upstream before serving
    (its lines on stdout) and exits with status 1, serving nothing, when one fails: a
    vLLM the counter does not mirror, or one started without the flags billing reads.
    Off by default, so the counter can start before vLLM; --upstream-wait-s first waits
    that long for every upstream's /health.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import TYPE_CHECKING

from tokengate import config as tg_config
from tokengate import grpc_server, metrics
from tokengate import version as tg_version

if TYPE_CHECKING:
    import grpc


def new_grpc_server(threads: int) -> grpc.Server:
    """A worker's gRPC server, no servicer added yet: ``threads`` RPC threads, request
    bodies up to 64 MiB (``make bench-counter`` serves its no-op counter with it too)."""
    from concurrent import futures

    import grpc

    return grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                       options=[*grpc_server.OPTIONS,
                                ("grpc.max_receive_message_length", 64 << 20)])


def _serve_worker(config_path: str | None, listen: grpc_server.Listen, threads: int,
                  index: int) -> None:
    """One worker process: load every model, serve until SIGTERM/SIGINT."""
    from tokengate.counter import kv_index
    from tokengate.counter.counter_service import TokenCounterService
    from tokengate.counter.counting import ModelCounter
    from tokengate.v1 import counter_pb2, counter_pb2_grpc

    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s counter worker {index} %(levelname)s %(message)s")

    # the replicas' KV events (models routed by the prefix cache): followed by threads
    # of this process, kept across reloads where unchanged
    events = kv_index.KvEvents()

    def load() -> dict[str, ModelCounter]:
        cfg = tg_config.load(config_path)
        allowed = cfg.edge.chat_template_kwargs_allowed
        indexes = events.sync((name, m.kv_events) for name, m in cfg.models.items())
        return {name: ModelCounter.load(m, allowed, indexes.get(name))
                for name, m in cfg.models.items()}

    counters = load()
    service = TokenCounterService(counters)
    server = new_grpc_server(threads)
    counter_pb2_grpc.add_TokenCounterServicer_to_server(service, server)
    service_name = counter_pb2.DESCRIPTOR.services_by_name["TokenCounter"].full_name

    def reload() -> None:
        # one assignment: a call reads service.counters once, so it sees the old models
        # or the new ones, never a mix
        service.counters = load()
        print(f"counter worker {index}: configuration reloaded: models "
              f"{', '.join(service.counters)}", flush=True)

    def ready(addresses: list[str]) -> None:
        for name, c in counters.items():
            why = f" ({c.tokenizer.why_not_fast})" if c.tokenizer.why_not_fast else ""
            template = "none" if c.template is None else "traced" \
                if not c.template.why_not_traced else \
                f"rendered every time ({c.template.why_not_traced})"
            print(f"counter worker {index}: model {name}: backend {c.tokenizer.backend}{why}, "
                  f"chat template {template}, fingerprint {c.fingerprint}", flush=True)
        print(f"counter worker {index}: listening on {', '.join(addresses)}", flush=True)

    import asyncio

    from tokengate.counter import frames

    try:
        asyncio.run(frames.serve(service.count, listen, index, grace_s=2, tcp_server=server,
                                 services=[service_name], on_ready=ready, on_reload=reload))
    finally:
        events.close()


def _preload(cfg: tg_config.Config) -> None:
    """In the parent (``cfg``: the configuration main() read), before the workers are
    forked: import the worker's modules and load every model once, so that each worker
    finds the parsed tokenizers (``tokengate.counter.tokenizer``'s cache of parsed
    files) and the libraries in memory it shares with the parent: a worker is serving
    after ~0.1 CPU-s instead of ~1.7 (the demo model; the whole counter with two
    workers: 3.8 -> 2.0 CPU-s, ready in 1.6 s instead of 2.1, on 2 cores; 251 MB of
    memory (PSS) instead of 484). A model that does not load here is left to the
    worker, which says why and exits."""
    from tokengate.counter import counter_service, frames  # noqa: F401  (imported to share)
    from tokengate.counter.counting import ModelCounter

    for m in cfg.models.values():
        with contextlib.suppress(Exception):  # the worker's own load says why
            ModelCounter.load(m, cfg.edge.chat_template_kwargs_allowed)


def _check_upstreams(cfg: tg_config.Config, allow_unverified: bool, wait_s: float) -> None:
    """`tokengate doctor`'s upstream checks in the parent, once, before any worker starts,
    each line on stdout; exits 1 on a failed check. They run as a child process,
    ``python -m tokengate.doctor.preflight``: the doctor is an operator's tool, of the
    layer above the services, and the parent does not keep the models it loads."""
    import os
    import subprocess

    argv = [sys.executable, "-m", "tokengate.doctor.preflight", "--config", str(cfg.path),
            "--wait-s", str(wait_s), *(["--allow-unverified-vllm"] if allow_unverified else [])]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as child:
        assert child.stdout is not None
        for line in child.stdout:
            print("counter: upstream check: " + line.rstrip("\n"), flush=True)
    if child.returncode == 1:
        print("tokengate-counter: an upstream check failed (lines above); not serving",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if child.returncode != 0:
        print(f"tokengate-counter: the upstream check exited with status {child.returncode}; "
              "not serving", file=sys.stderr, flush=True)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokengate-counter", description=__doc__.split("DESCRIPTION")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    parser.add_argument("--host", default="127.0.0.1", help="TCP address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051,
                        help="TCP port (default: %(default)s); 0: no TCP listener, the unix "
                             "sockets only (needs --unix-socket)")
    parser.add_argument("--unix-socket", default=None,
                        help="also listen on PATH.<i> for worker i (counter frames, the "
                             "edge's calls)")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="gRPC threads per worker, for HOST:PORT (default: "
                             "%(default)s: the GIL runs one call at a time anyway, and a "
                             "second thread made each call cost 15-25%% more CPU in make "
                             "bench-counter)")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="serve Prometheus /metrics there, all workers summed "
                             "(default: metrics.counter_listen; 'none': off)")
    parser.add_argument("--check-upstreams", action="store_true",
                        help="check every upstream as `tokengate doctor` does before serving; "
                             "exit 1 when a check fails (default: off)")
    parser.add_argument("--allow-unverified-vllm", action="store_true",
                        help="with --check-upstreams: a vLLM release the counter was not "
                             "verified against only warns")
    parser.add_argument("--upstream-wait-s", type=float, default=0.0,
                        help="with --check-upstreams: wait up to this long for every "
                             "upstream's /health first, s (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        cfg = tg_config.load(args.config)
    except (OSError, tg_config.ConfigError) as e:
        sys.exit(f"tokengate-counter: {e}")
    if args.port == 0 and args.unix_socket is None:
        sys.exit("tokengate-counter: --port 0 needs --unix-socket")
    if args.check_upstreams:
        _check_upstreams(cfg, args.allow_unverified_vllm, args.upstream_wait_s)
    tcp = (f"{args.host}:{args.port}",) if args.port else ()
    try:
        listen = grpc_server.Listen(tcp, args.unix_socket)
    except ValueError as e:
        sys.exit(f"tokengate-counter: {e}")
    print(f"tokengate-counter {tg_version.describe()}: starting", flush=True)
    metrics.serve(args.metrics_listen or cfg.metrics.counter_listen, "counter", args.workers)
    grpc_server.run_workers("counter", _serve_worker, (args.config, listen, args.threads),
                            args.workers, listen, preload=lambda: _preload(cfg))


if __name__ == "__main__":
    main()
