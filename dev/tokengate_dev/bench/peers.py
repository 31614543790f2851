"""``make bench-peers``: tokengate beside two other gateways, on one fast upstream.

The peers, each installed on demand in an environment of its own under
``~/.cache/tokengate/peers`` (nothing else is fetched; a peer whose install fails is
reported and skipped):

- **LiteLLM's proxy** (the ``litellm[proxy]`` Python package, in a virtual environment
  of its own): one model entry pointing at the fast upstream as an OpenAI-compatible
  server, one process (``--litellm-workers N`` for more: with 2 its uvicorn workers
  were seen to die and respawn without a line of log on this machine), a master key,
  no database, no callbacks;
- **Portkey's gateway** (the ``@portkey-ai/gateway`` npm package, run with Node):
  one process (as it ships), the upstream given per request in Portkey's own headers
  (``x-portkey-provider: openai``, ``x-portkey-custom-host``). It checks no key, limits
  nothing and counts nothing.

tokengate runs as ``make bench`` runs it (exact count, RPM/TPM reserved, a usage event
per request). Every side gets the same requests: 1,000-token chat prompts (fresh ones
in every run: a seed per run), 16 output tokens, not streamed; first each at
saturation (closed loop, CPU per request of the side's processes), then each at
``storm.AIM_RATE`` req/s, open loop, for the latency added over the upstream alone.
The peers count no tokens, so their runs do not check the upstream's prompt tokens
(the upstream estimates them where no ``X-Token-Count`` reaches it).

Printed: each side's figures, tokengate's ratios to each peer, and the aims
(``AIMS``) met or not. Results: ``bench/results/peers-<time>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokenstorm import report
from tokenstorm.null_server import FastUpstream, free_port
from tokenstorm.process import Service, ServiceError, tcp_ready
from tokenstorm.runner import RunSpec
from tokenstorm.upstream import UpstreamOptions

from tokengate_dev import devstack
from tokengate_dev.bench import stack, storm

PEERS_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
    / "tokengate" / "peers"
PEERS_VAR = stack.BENCH_VAR / "peers"
PEER_KEY = "sk-tokengate-bench"  # what the peers pass on to the upstream, which ignores it
INSTALL_TIMEOUT_S = 900.0

# (label, figure, comparison, target, the peer, the sides' runs it comes from):
# tokengate against the peers, same run
AIMS = [
    ("tokengate saturation / Portkey's (req/s ratio)", "rps_ratio_portkey", ">=", 2.0,
     "Portkey", "saturation_valid"),
    ("tokengate saturation / LiteLLM's (req/s ratio)", "rps_ratio_litellm", ">=", 7.0,
     "LiteLLM", "saturation_valid"),
    ("tokengate added p50 / Portkey's, 100 req/s", "added_p50_ratio_portkey", "<", 1.0,
     "Portkey", "rate_valid"),
]


@dataclasses.dataclass
class Peer:
    """A gateway beside tokengate: its service, its URL (``…/v1``), the API key and the
    headers every request carries, its version."""

    name: str
    service: Service
    url: str
    key: str = PEER_KEY
    headers: tuple[tuple[str, str], ...] = ()
    version: str = ""


def _install(console: Console, what: str, argv_list: list[list[str]],
             log: Path) -> bool:
    """Runs each command of ``argv_list`` in turn (output to ``log``): True when all
    succeeded; else says so and returns False."""
    console.print(f"  installing {what} (once, into {PEERS_DIR}) ...")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for argv in argv_list:
            try:
                p = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False,
                                   timeout=INSTALL_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                console.print(f"  [red]{what}: install failed ({e}); skipped[/]")
                return False
            if p.returncode != 0:
                console.print(f"  [red]{what}: `{' '.join(argv)}` failed ({p.returncode}, "
                              f"see {log}); skipped[/]")
                return False
    return True


def litellm_executable(console: Console) -> Path | None:
    """``litellm`` of the peers' LiteLLM virtual environment, made and filled with
    ``litellm[proxy]`` when missing; None when that fails."""
    venv = PEERS_DIR / "litellm"
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe
    shutil.rmtree(venv, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    ok = _install(console, "LiteLLM's proxy (litellm[proxy])",
                  [[base, "-m", "venv", str(venv)],
                   [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                    "litellm[proxy]"]], PEERS_DIR / "litellm-install.log")
    return exe if ok and exe.exists() else None


def portkey_script(console: Console) -> Path | None:
    """Portkey's gateway server script under the peers' npm folder, installed with
    ``npm`` when missing; None when that fails (or there is no npm or node)."""
    folder = PEERS_DIR / "portkey"
    script = folder / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    if script.exists():
        return script
    if shutil.which("npm") is None or shutil.which("node") is None:
        console.print("  [red]Portkey's gateway: no npm or node on PATH; skipped[/]")
        return None
    folder.mkdir(parents=True, exist_ok=True)
    ok = _install(console, "Portkey's gateway (@portkey-ai/gateway)",
                  [["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                    "@portkey-ai/gateway"]], PEERS_DIR / "portkey-install.log")
    return script if ok and script.exists() else None


def litellm_peer(exe: Path, upstream_port: int, model: str, workers: int) -> Peer:
    """LiteLLM's proxy with one model entry for the fast upstream, ``workers`` uvicorn
    workers, telemetry and the remote model cost map off, a master key of its own (it
    refuses to start without one; every request is checked against it, no database)."""
    port = free_port()
    master = "sk-" + secrets.token_hex(24)
    PEERS_VAR.mkdir(parents=True, exist_ok=True)
    cfg = PEERS_VAR / "litellm.yaml"
    cfg.write_text(json.dumps({
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"openai/{model}", "api_base": f"http://127.0.0.1:{upstream_port}/v1",
            "api_key": PEER_KEY}}],
        "litellm_settings": {"telemetry": False, "drop_params": True}}))
    env = {"LITELLM_MASTER_KEY": master, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
           "LITELLM_TELEMETRY": "False", "DO_NOT_TRACK": "1", "NO_DOCS": "True"}
    svc = Service("bench-peer-litellm",
                  [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                   "--num_workers", str(workers)],
                  tcp_ready("127.0.0.1", port), env, 300.0, cwd=PEERS_VAR,
                  log_dir=devstack.VAR / "log")
    return Peer("LiteLLM", svc, f"http://127.0.0.1:{port}/v1", key=master,
                version=_pip_version(exe.parent / "python", "litellm"))


def portkey_peer(script: Path, upstream_port: int) -> Peer:
    """Portkey's gateway (one Node process, headless), the upstream in each request's
    ``x-portkey-provider`` and ``x-portkey-custom-host`` headers."""
    port = free_port()
    svc = Service("bench-peer-portkey", ["node", str(script), f"--port={port}", "--headless"],
                  tcp_ready("127.0.0.1", port), {"NODE_ENV": "production"}, 60.0,
                  cwd=script.parent, log_dir=devstack.VAR / "log")
    package = json.loads((script.parent.parent / "package.json").read_text())
    return Peer("Portkey", svc, f"http://127.0.0.1:{port}/v1",
                headers=(("x-portkey-provider", "openai"),
                         ("x-portkey-custom-host", f"http://127.0.0.1:{upstream_port}/v1")),
                version=str(package.get("version", "")))


def _pip_version(python: Path, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    p = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                       check=False, timeout=60)
    return p.stdout.strip()


def ratios(sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """tokengate's ratios to each peer from the sides' figures (``rps``, ``cpu_us``,
    ``added_p50_ms``, ``added_p99_ms``; a side or figure missing gives no ratio):
    ``rps_ratio_<peer>`` (tokengate / peer saturation), ``cpu_ratio_<peer>`` (tokengate /
    peer CPU per request), ``added_p50_ratio_<peer>`` and ``added_p99_ratio_<peer>``
    (tokengate's added latency / the peer's). Peers are keyed by lower-cased name."""
    tg = sides.get("tokengate", {})
    out: dict[str, float] = {}
    for name, peer in sides.items():
        if name in ("tokengate", "direct"):
            continue
        key = name.lower()
        for fig, label in (("rps", "rps_ratio"), ("cpu_us", "cpu_ratio"),
                           ("added_p50_ms", "added_p50_ratio"),
                           ("added_p99_ms", "added_p99_ratio")):
            a, b = tg.get(fig), peer.get(fig)
            if a is not None and b:
                out[f"{label}_{key}"] = a / b
    return out


def run_peers(opts: stack.BenchOptions, workers: int, console: Console) -> dict[str, Any]:
    """Everything ``make bench-peers`` measures, as the JSON it writes."""
    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml").models
    model = next(iter(cfg.values()))
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": stack.machine(), "options": vars(opts).copy(),
                           "runs": {}, "sides": {}, "skipped": {}}
    runs, sides = out["runs"], out["sides"]
    lite = litellm_executable(console)
    portkey = portkey_script(console)
    if lite is None:
        out["skipped"]["LiteLLM"] = "install failed"
    if portkey is None:
        out["skipped"]["Portkey"] = "install failed"
    up_opts = UpstreamOptions(model=model.name, max_model_len=model.max_model_len)
    with FastUpstream(up_opts, name="bench-peers-upstream", state_dir=devstack.VAR) as up:
        gw = stack.Gateway(up.port, opts, name="peers-gateway")
        peers = [p for p in (portkey_peer(portkey, up.port) if portkey else None,
                             litellm_peer(lite, up.port, model.name, workers) if lite
                             else None) if p is not None]
        started: list[Any] = []
        try:
            with console.status("starting tokengate and the peers ..."):
                started.append(gw.start())
                for p in peers:
                    try:
                        started.append(p.service.start())
                    except ServiceError as e:  # a peer that does not start is skipped
                        console.print(f"  [red]{p.name} did not start: {e}[/]")
                        out["skipped"][p.name] = f"did not start: {str(e)[:300]}"
                peers = [p for p in peers if p.name not in out["skipped"]]
            out["versions"] = {p.name: p.version for p in peers}
            targets: list[tuple[str, str, Peer | None, dict[str, int]]] = [
                ("direct", up.url, None, {}), ("tokengate", gw.url, None, gw.groups())]
            for p in peers:
                assert p.service.proc is not None
                targets.append((p.name, p.url, p, {p.name: p.service.proc.pid}))
            console.rule(f"saturation: {opts.prompt_tokens}-token chats, {opts.output_tokens} "
                         f"output tokens, {opts.concurrency} in flight, {opts.duration_s:g} s")
            for name, url, peer, groups in targets:
                r = storm._run(_peer_spec(name, url, peer, model, opts,
                                          concurrency=opts.concurrency),
                               console, runs, groups or None)
                per = runs[r.spec.name].get("cpu_us_per_request", {})
                sides[name] = {"rps": r.summary.all.rps, "saturation_valid": r.summary.valid,
                               "failed": r.summary.requests - r.summary.all.ok,
                               "cpu_us": round(sum(per.get(g, 0.0) for g in groups), 1)
                               if groups else None}
            rate = storm.AIM_RATE
            console.rule(f"added latency at {rate:g} req/s (open loop)")
            summaries = {}
            for name, url, peer, _ in targets:
                summaries[name] = storm._run(_peer_spec(name, url, peer, model, opts,
                                                        rate=rate), console, runs).summary
            d = summaries["direct"]
            for name, s in summaries.items():
                if name != "direct":
                    sides[name].update(
                        added_p50_ms=storm._sub(s.all.e2e_ms.p50, d.all.e2e_ms.p50),
                        added_p99_ms=storm._sub(s.all.e2e_ms.p99, d.all.e2e_ms.p99),
                        rate_valid=s.valid and d.valid)
        finally:
            for svc in reversed(started):
                svc.stop()
    out["figures"] = ratios(sides)
    return out


def _peer_spec(name: str, url: str, peer: Peer | None, model: tg_config.ModelConfig,
               opts: stack.BenchOptions, *, concurrency: int = 0,
               rate: float | None = None) -> RunSpec:
    """A side's run: direct's and tokengate's as ``make bench`` makes them, a peer's
    with its key and headers and no check of the prompt tokens the upstream reports."""
    mode = "saturation" if concurrency else f"{rate:g} req/s"
    spec = storm._spec(f"{name} {mode}", url, model, opts, stream=False, rate=rate,
                       concurrency=concurrency, direct=name != "tokengate")
    if peer is None:
        return spec
    return dataclasses.replace(spec, headers=peer.headers, keys=(peer.key,),
                               send_token_count=True, check_prompt_tokens=False)


def render(out: dict[str, Any]) -> list[Table]:
    """The sides' figures, then the aims."""
    sides, fig = out["sides"], out["figures"]
    t = Table(title="make bench-peers: the same requests through each side",
              header_style="bold")
    for c in ("side", "saturation req/s", "CPU µs/request", "added p50 ms", "added p99 ms"):
        t.add_column(c, justify="left" if c == "side" else "right")
    for name, s in sides.items():
        t.add_row(f"{name} {out.get('versions', {}).get(name, '')}".strip(),
                  f"{s['rps']:,.0f}" + ("" if s["saturation_valid"] else " (invalid)"),
                  "-" if s.get("cpu_us") is None else f"{s['cpu_us']:,.0f}",
                  *("-" if s.get(k) is None else f"{s[k]:+.2f}"
                    for k in ("added_p50_ms", "added_p99_ms")))
    for name, why in out.get("skipped", {}).items():
        t.add_row(name, "skipped", why, "", "")
    a = Table(title="tokengate against the peers (same run)", header_style="bold")
    for c in ("ratio", "measured", "aim", ""):
        a.add_column(c, justify="left" if c == "ratio" else "right")
    for key, v in fig.items():
        if not any(key == aim[1] for aim in AIMS):
            a.add_row(key, f"{v:.2f}", "", "")
    for label, name, op, target, peer, valid in AIMS:
        v = fig.get(name)
        if v is None:
            a.add_row(label, "-", f"{op} {target:g}", "not measured")
            continue
        met = v >= target if op == ">=" else v < target
        invalid = [side for side in ("tokengate", peer)
                   if not sides.get(side, {}).get(valid, True)]
        a.add_row(label, f"{v:.2f}", f"{op} {target:g}",
                  ("[green]met[/]" if met else "[red]not met[/]")
                  + (f" (invalid run: {', '.join(invalid)})" if invalid else ""))
    return [t, a]


def main(argv: list[str] | None = None) -> None:
    p = storm.arguments("tokengate_dev.bench.peers", __doc__)
    p.add_argument("--litellm-workers", type=int, default=1,
                   help="LiteLLM proxy's uvicorn workers (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                   help="result file (default: bench/results/peers-<time>.json)")
    a = p.parse_args(argv)
    opts = stack.BenchOptions(duration_s=a.duration, concurrency=a.concurrency)
    console = Console(width=None if sys.stdout.isatty() else 110)
    m = stack.machine()
    console.print(f"make bench-peers: {m['cpus']} CPUs, load average {m['loadavg_before']} "
                  "(numbers are this machine's, loopback only)")
    t0 = time.monotonic()
    out = run_peers(opts, a.litellm_workers, console)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = a.out or stack.RESULTS / f"peers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report._clean(out), indent=2) + "\n")
    for table in render(out):
        console.print(table)
    console.print(f"results: {path} ({out['elapsed_s']:g} s)")


if __name__ == "__main__":
    main()
