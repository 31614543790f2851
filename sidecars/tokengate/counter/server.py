"""tokengate-counter: the exact prompt-token counter, served over gRPC.

NAME
    tokengate-counter - count the prompt tokens of OpenAI-style request bodies exactly

SYNOPSIS
    tokengate-counter [--config FILE] [--host HOST] [--port PORT]
                      [--unix-socket PATH] [--workers N] [--threads T]

DESCRIPTION
    Serves tokengate.v1.TokenCounter/CountTokens (proto/tokengate/v1/counter.proto),
    the standard gRPC health service (grpc.health.v1.Health) and server reflection.
    Models come from the YAML configuration (models.<name>.dir: the served model's own
    directory, the same tokenizer.json and chat template vLLM loads).

    Python holds one GIL per process, so the counter runs N worker processes. Every
    worker listens on HOST:PORT (SO_REUSEPORT: the kernel spreads connections) and, with
    --unix-socket PATH, on its own socket PATH.<i> (i = 0..N-1), which the nginx edge
    lists as the servers of its counter upstream. The parent restarts a worker that
    dies and stops all of them on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from tokengate import config as tg_config


def _serve_worker(config_path: str | None, host: str, port: int, unix_socket: str | None,
                  index: int, threads: int = 2) -> None:
    """One worker process: load every model, serve until SIGTERM/SIGINT."""
    import threading
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from tokengate.counter.counter_service import TokenCounterService
    from tokengate.counter.counting import ModelCounter
    from tokengate.v1 import counter_pb2, counter_pb2_grpc

    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s counter worker {index} %(levelname)s %(message)s")
    cfg = tg_config.load(config_path)
    counters = {name: ModelCounter.load(m) for name, m in cfg.models.items()}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                         options=[("grpc.so_reuseport", 1),
                                  ("grpc.max_receive_message_length", 64 << 20)])
    counter_pb2_grpc.add_TokenCounterServicer_to_server(TokenCounterService(counters), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = counter_pb2.DESCRIPTOR.services_by_name["TokenCounter"].full_name
    reflection.enable_server_reflection(
        (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    addresses = [f"{host}:{port}"]
    sock = f"{unix_socket}.{index}" if unix_socket else None
    if sock:
        Path(sock).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(sock):
            os.unlink(sock)
        addresses.append(f"unix:{sock}")
    for addr in addresses:
        server.add_insecure_port(addr)
    server.start()
    if sock:
        os.chmod(sock, 0o666)  # nginx workers may run as another user
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for name, c in counters.items():
        why = f" ({c.tokenizer.why_not_fast})" if c.tokenizer.why_not_fast else ""
        print(f"counter worker {index}: model {name}: backend {c.tokenizer.backend}{why}, "
              f"fingerprint {c.fingerprint}", flush=True)
    print(f"counter worker {index}: listening on {', '.join(addresses)}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2).wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokengate-counter", description=__doc__.split("DESCRIPTION")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="YAML configuration (default: $TOKENGATE_CONFIG, else "
                             "./tokengate.yaml, else /etc/tokengate/tokengate.yaml)")
    parser.add_argument("--host", default="127.0.0.1", help="TCP address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="TCP port (default: %(default)s)")
    parser.add_argument("--unix-socket", default=None,
                        help="also listen on PATH.<i> for worker i")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2,
                        help="RPC threads per worker (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        tg_config.load(args.config)
    except (OSError, tg_config.ConfigError) as e:
        sys.exit(f"tokengate-counter: {e}")
    if args.workers <= 1:
        _serve_worker(args.config, args.host, args.port, args.unix_socket, 0, args.threads)
        return

    ctx = multiprocessing.get_context("spawn")
    worker_args = (args.config, args.host, args.port, args.unix_socket)
    procs = {i: ctx.Process(target=_serve_worker, args=(*worker_args, i, args.threads),
                            daemon=True)
             for i in range(args.workers)}
    for p in procs.values():
        p.start()
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        time.sleep(0.5)
        for i, p in list(procs.items()):
            if not p.is_alive() and not stopping:
                print(f"counter worker {i} exited with {p.exitcode}; restarting", flush=True)
                procs[i] = ctx.Process(target=_serve_worker,
                                       args=(*worker_args, i, args.threads), daemon=True)
                procs[i].start()
    for p in procs.values():
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    for p in procs.values():
        p.join(5)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
