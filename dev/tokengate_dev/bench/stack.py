"""The parts ``make bench`` (and ``make bench-peers``) start and how their CPU is read:
the bench's options, each run's prompt seed, the tokengate stack under test
(``Gateway``: counter, nginx edge, optionally a ledger), the plain nginx reference, the
CPU time of process groups from ``/proc``."""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml
from tokenstorm.null_server import free_port
from tokenstorm.process import Service, tcp_ready

from tokengate_dev import devstack

RESULTS = devstack.ROOT / "bench" / "results"
BENCH_VAR = devstack.VAR / "bench"
BENCH_KEY = "tg-bench-key"


@dataclass
class BenchOptions:
    """``make bench`` knobs: prompt and output tokens, run length (s), closed-loop
    concurrency, fixed rates (req/s; empty: 100 and 25 % of the gateway's saturation),
    TokenStorm workers, nginx edge workers and counter workers."""

    prompt_tokens: int = 1000
    output_tokens: int = 16
    duration_s: float = 4.0
    concurrency: int = 64
    rates: list[float] = field(default_factory=list)
    workers: int = 1
    edge_workers: int = 2
    counter_workers: int = 2
    vllm_bench_prompts: int = 2500
    ceiling_tries: int = 2
    skip_vllm_bench: bool = False
    skip_gateway: bool = False
    skip_tracing: bool = False
    same_prompts: bool = False


# Each run's prompt seed (TokenStorm's prompts are a function of the seed and the
# request's index: the same seed, the same bodies).
_seeds = itertools.count(1)


def prompt_seed(opts: BenchOptions) -> int:
    """The seed of a run's prompts: a new one per call (fresh prompts: no body seen
    before in this process's gateways), or 0 for every run with ``same_prompts``."""
    return 0 if opts.same_prompts else next(_seeds)


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pgids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system, s) used so far by each named process group (a service
    started by devstack is its own group). Reaped children count too (cutime, cstime)."""
    want = {v: k for k, v in pgids.items()}
    out = dict.fromkeys(pgids, 0.0)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        pgrp = int(fields[2])
        if pgrp in want:
            out[want[pgrp]] += sum(int(x) for x in fields[11:15]) / _TICK
    return out


def machine() -> dict[str, Any]:
    """This machine for a result file: CPUs, load average before the runs, Python."""
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load],
            "python": sys.version.split()[0]}


class Gateway:
    """The tokengate stack for the bench: counter + nginx edge, the model's upstream
    pointed at the fast upstream, one key with limits far above the load (the limits
    are still enforced and reserved on every request); files under ``var/bench/<name>``.
    With ``redis_url`` a ledger too, applying the usage events to that Redis; with
    ``tracing`` (the tracing section) the edge traces every request and the ledger
    exports the spans."""

    def __init__(self, upstream_port: int, opts: BenchOptions, name: str = "gateway",
                 redis_url: str | None = None, tracing: dict[str, Any] | None = None) -> None:
        self.port = free_port()
        self.opts = opts
        self.name = name
        self.redis_url = redis_url
        self.dir = BENCH_VAR / name
        self.services: list[devstack.Service] = []
        self.dir.mkdir(parents=True, exist_ok=True)
        raw = yaml.safe_load((devstack.ROOT / "tokengate.yaml").read_text())
        for m in raw["models"].values():
            m["dir"] = str((devstack.ROOT / m["dir"]).resolve())
            m["upstreams"] = [f"127.0.0.1:{upstream_port}"]
        raw["keys"] = {"bench": {"sha256": hashlib.sha256(BENCH_KEY.encode()).hexdigest(),
                                 "rpm": 1_000_000_000, "tpm": 1_000_000_000_000}}
        usage = self.dir / "usage.jsonl"
        usage.unlink(missing_ok=True)
        raw.setdefault("ledger", {})["usage_file"] = str(usage)
        raw.setdefault("edge", {})["listen"] = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.status_port = free_port()
        raw["metrics"] = {"counter_listen": None, "limits_listen": None,
                          "ledger_listen": f"127.0.0.1:{self.metrics_port}"}
        if tracing:
            raw["tracing"] = tracing
        self.config_path = self.dir / "tokengate.yaml"
        self.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        self.usage_file = usage

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Gateway:
        """Counter, then the edge: the builders ``make run`` uses."""
        sock = self.dir / "counter.sock"
        counter = devstack.counter_service(self.config_path, port=free_port(),
                                           unix_socket=sock, workers=self.opts.counter_workers,
                                           name=f"bench-{self.name}-counter")
        self.services.append(counter.start())
        edge = devstack.nginx_service(self.config_path, port=self.port, counter_socket=sock,
                                      counter_workers=self.opts.counter_workers,
                                      workers=self.opts.edge_workers,
                                      name=f"bench-{self.name}-edge",
                                      prefix=self.dir / "edge", status_port=self.status_port)
        self.services.append(edge.start())
        if self.redis_url:
            ledger = devstack.ledger_service(self.config_path, self.usage_file, self.redis_url,
                                             ledger_id=f"bench-{self.name}",
                                             name=f"bench-{self.name}-ledger")
            self.services.append(ledger.start())
        return self

    def ledger_metrics(self) -> dict[str, float]:
        """The ledger's tokengate_* samples (name with labels -> value), {} without one."""
        if not self.redis_url:
            return {}
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                            if line.startswith("tokengate_"))}

    def count_seconds(self) -> tuple[float, float]:
        """The edge's counts so far (``count_seconds`` of its /metrics)."""
        import urllib.request

        url = f"http://127.0.0.1:{self.status_port}/metrics"
        return count_seconds(urllib.request.urlopen(url, timeout=5).read().decode())

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()

    def groups(self) -> dict[str, int]:
        """Process groups for CPU accounting: counter (all workers), edge (master and
        workers)."""
        return {name: s.proc.pid for name, s in zip(("counter", "edge nginx", "ledger"),
                                                    self.services)
                if s.proc is not None}


# The reference: the same nginx binary proxying to the fast upstream with the edge's
# connection settings (nginx/nginx.conf.in, the tokengate_vllm upstream of
# tokengate-http.conf.in and the proxy directives of tokengate-location.conf.in), no
# Lua module loaded: what nginx alone costs per request.
PLAIN_NGINX_CONF = """worker_processes {workers};
daemon off;
pid {prefix}/nginx.pid;
error_log stderr notice;
events {{
    worker_connections 4096;
}}
http {{
    client_body_temp_path {prefix}/tmp/client_body;
    proxy_temp_path {prefix}/tmp/proxy;
    default_type application/octet-stream;
    server_tokens off;
    access_log off;
    keepalive_timeout 75s;
    upstream fast_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
        keepalive_timeout 4s;
        keepalive_requests 10000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            client_max_body_size 64m;
            client_body_buffer_size 16k;
            proxy_pass http://fast_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "";
            proxy_set_header Accept-Encoding "";
            proxy_set_header X-Request-Id $request_id;
            proxy_buffering off;
            proxy_cache off;
            gzip off;
            proxy_connect_timeout 3s;
            proxy_send_timeout 60s;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def count_seconds(metrics: str) -> tuple[float, float]:
    """The edge's ``tokengate_count_duration_seconds`` in ``metrics`` (its /metrics, the
    Prometheus text format), every label set's: (sum in seconds, number of counts). A
    count is the edge's wait for the counter's answer (the unix-socket call, the
    counter's wake-up and its work) or a hit in the edge's cache of its answers."""
    from prometheus_client.parser import text_string_to_metric_families

    total = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(metrics):
        if family.name == "tokengate_count_duration_seconds":
            for sample in family.samples:
                suffix = sample.name.removeprefix(family.name)
                if suffix in total:
                    total[suffix] += sample.value
    return total["_sum"], total["_count"]


def plain_nginx_service(upstream_port: int, workers: int) -> tuple[Service, int]:
    """nginx with ``PLAIN_NGINX_CONF`` in front of the fast upstream: (service, port)."""
    port = free_port()
    prefix = (BENCH_VAR / "plain-nginx").resolve()
    for d in ("tmp/client_body", "tmp/proxy"):
        (prefix / d).mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(PLAIN_NGINX_CONF.format(workers=workers, prefix=prefix, port=port,
                                            upstream_port=upstream_port))
    svc = Service("bench-plain-nginx", ["nginx", "-p", str(prefix), "-c", str(conf), "-e",
                                        "stderr"], tcp_ready("127.0.0.1", port), {}, 20.0,
                  cwd=devstack.ROOT, log_dir=devstack.VAR / "log")
    return svc, port
