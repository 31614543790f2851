"""``tokenstorm``: the command line of TokenStorm (see ``tokenstorm --help``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokengate import config as tg_config

from tokenstorm.arrivals import PROCESSES, ArrivalSpec
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import Sharing, StreamOptions
from tokenstorm.report import SLO

if TYPE_CHECKING:
    from tokenstorm.runner import RunResult

MAN = """\
TokenStorm is a token-level load generator for OpenAI-compatible LLM servers and
gateways. Load is described in tokens: arrivals are open-loop (a request leaves at
its scheduled time whatever happened to earlier ones) at a target in requests/s or
in tokens/s, prompts are built to an exact number of prompt tokens with the served
model's tokenizer and chat template, and every response's usage.prompt_tokens is
checked against that number.

COMMANDS
  run        send a load and report it (the default when no command is given)
  ceiling    measure TokenStorm's own ceiling against a null server
  upstream   run the fast upstream: an nginx + Lua server that answers like vLLM
  sim-replica
             run a simulated vLLM replica with a real prefix cache and KV events
  capacity   how many GPU replicas of a model serve a request mix at a rate within a
             TPOT target, from the simulated replica's roofline

MEASURES (ms, from the scheduled send time)
  TTFT  first token event          ITL   gap between token events (pooled)
  TPOT  (e2e - ttft) / (completion_tokens - 1), as vLLM's benchmark
  E2E   end of response            lag   actual minus scheduled send
  Throughput in requests/s, output tokens/s and total tokens/s; goodput is the
  rate of requests that meet every SLO (--slo). 429s are split by the limit that
  refused (requests or tokens) with the tokens rejected and admitted. A burst
  profile reports burst and steady windows apart.

VALIDITY
  An open-loop run is INVALID when more than 1 % of its requests left more than
  --max-lag-ms after their scheduled time (the generator fell behind and the load
  was not the one asked for), or when a server-reported prompt token count differs
  from the planned one. Invalid runs exit with status 2.

EXIT STATUS
  0 valid run, 1 error (bad option, cannot connect), 2 run completed but invalid.

FILES
  tokengate.yaml (--config)  model name, model directory and max_model_len defaults
  --out FILE.json            summary of the run; --plots DIR: latency CDFs and
                             throughput/429s over time as PNG
"""

RUN_EXAMPLES = """\
EXAMPLES
  Poisson arrivals at 200 requests/s for 30 s through the gateway, streaming:
    tokenstorm run --url http://127.0.0.1:8080/v1 --api-key tg-demo-key \\
        --rate 200 --duration 30 --stream

  A 400k tokens/s target with the burst profile and two API keys, plots and JSON:
    tokenstorm run --token-rate 400000 --profile burst --duration 120 \\
        --api-key KEY1 --api-key KEY2 --out runs/burst.json --plots runs/

  Saturation: 64 requests in flight per worker, 1000-token prompts, 16 output tokens:
    tokenstorm run --concurrency 64 --profile normal:mean=1000,sd=0 --output-tokens 16

  Prefix-cache traffic: 16 tenants with 3000-token system prompts, two conversations
  each (the report adds the cached-token ratio the server's prefix cache reached):
    tokenstorm run --tenants 16 --shared-prefix-tokens 3000 --conversations 2 \\
        --profile normal:mean=4000,sd=400 --output-tokens 32 --stream

  Replay a trace (JSONL: timestamp, input_tokens, output_tokens) twice as fast:
    tokenstorm run --profile trace:path=trace.jsonl,speed=2 --duration 600

PROFILES (--profile NAME[:key=value,...])
  normal      mean=2000 sd=500 input tokens
  long_tail   95 % around mean=1000 (sd=100), p_tail=0.05 around tail_mean=10000
  burst       10 s of every 60 s (burst_s, period_s): 500-8000 input tokens,
              otherwise 100-500 (burst_range=LO-HI, steady_range=LO-HI)
  trace       path=FILE.jsonl [speed=X]
  Output tokens: round(1.8 x input) (--output-ratio), or --output-tokens N, capped
  so that input + output <= max_model_len (and by --max-output).
"""


def _defaults(config_path: str | None) -> tuple[str, Path | None, int]:
    try:
        cfg = tg_config.load(config_path)
    except (OSError, tg_config.ConfigError):
        return "tiny-qwen3", None, 8192
    if not cfg.models:
        return "tiny-qwen3", None, 8192
    m = next(iter(cfg.models.values()))
    return m.name, m.dir, m.max_model_len


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and prompts")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="tokengate.yaml for model defaults (default: $TOKENGATE_CONFIG, "
                        "else ./tokengate.yaml, else /etc/tokengate/tokengate.yaml)")
    g.add_argument("--model", default=None, help="served model name (default: the first "
                   "model of the config)")
    g.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                   help="the served model's directory: tokenizer.json, tokenizer_config.json "
                        "(default: from the config)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="context length used to cap lengths (default: from the config)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions (default: %(default)s)")
    g.add_argument("--profile", default="normal", metavar="SPEC",
                   help="token-length profile, see PROFILES (default: %(default)s)")
    g.add_argument("--output-ratio", type=float, default=1.8, metavar="X",
                   help="output tokens = X * input tokens (default: %(default)s)")
    g.add_argument("--output-tokens", type=int, default=None, metavar="N",
                   help="fixed output tokens per request (overrides --output-ratio)")
    g.add_argument("--max-output", type=int, default=None, metavar="N",
                   help="cap on output tokens per request")
    g.add_argument("--stream", action="store_true", help="stream responses (SSE)")
    g.add_argument("--no-usage", action="store_true",
                   help="streams: do not ask for stream_options.include_usage")
    g.add_argument("--no-continuous-usage", action="store_true",
                   help="streams: do not ask for cumulative usage in every chunk")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send vLLM's ignore_eos (outputs may end early)")
    g.add_argument("--seed", type=int, default=0, help="schedule and prompt seed "
                   "(default: %(default)s)")
    g.add_argument("--tenants", type=int, default=0, metavar="N",
                   help="shared prefixes: request j belongs to tenant j %% N, whose prompts "
                        "all start with its system prompt, then a conversation's history "
                        "(0: every prompt unique; default: %(default)s)")
    g.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="T",
                   help="tokens of each tenant's system prompt (default: %(default)s)")
    g.add_argument("--conversations", type=int, default=1, metavar="C",
                   help="conversations per tenant: successive turns of one extend the same "
                        "history (default: %(default)s)")
    c = p.add_argument_group("client")
    c.add_argument("--url", default="http://127.0.0.1:8080/v1",
                   help="API base URL (default: %(default)s, the gateway of `make run`)")
    c.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="API key; repeat for several keys, used round-robin "
                        "(default: $TOKENSTORM_API_KEY, else none)")
    c.add_argument("--send-token-count", action="store_true",
                   help="send X-Token-Count with the planned prompt tokens, as the gateway "
                        "does upstream (for direct runs against the fast upstream)")
    c.add_argument("--no-check-prompt-tokens", action="store_true",
                   help="do not mark the run invalid when reported prompt tokens differ")
    c.add_argument("--workers", type=int, default=1, metavar="N",
                   help="worker processes (default: %(default)s)")
    c.add_argument("--connections", type=int, default=32, metavar="N",
                   help="keep-alive connections opened per worker before the start "
                        "(default: %(default)s)")
    c.add_argument("--max-connections", type=int, default=4096, metavar="N",
                   help="connection cap per worker; requests beyond it wait (send lag) "
                        "(default: %(default)s)")
    c.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="per-request timeout in seconds (default: %(default)s)")


def _run_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    a = p.add_argument_group("load")
    a.add_argument("--arrivals", choices=PROCESSES, default="poisson",
                   help="arrival process (default: %(default)s)")
    a.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape: < 1 burstier than Poisson, > 1 smoother "
                        "(default: %(default)s)")
    t = a.add_mutually_exclusive_group()
    t.add_argument("--rate", type=float, default=None, metavar="REQ_PER_S",
                   help="target in requests/s (default: 10)")
    t.add_argument("--token-rate", type=float, default=None, metavar="TOKENS_PER_S",
                   help="target in tokens/s (prompt + output)")
    t.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="closed loop: N requests in flight per worker (saturation)")
    a.add_argument("--duration", type=float, default=10.0, metavar="S",
                   help="run length in seconds (default: %(default)s)")
    a.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="stop the schedule after N requests")
    a.add_argument("--max-lag-ms", type=float, default=10.0, metavar="MS",
                   help="a request sent later than this is late; > 1 %% late makes the run "
                        "invalid (default: %(default)s)")
    a.add_argument("--slo", default="ttft=1000,tpot=100", metavar="SPEC",
                   help="goodput SLOs in ms: ttft=,tpot=,e2e= (default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--name", default="run", help="run name in reports (default: %(default)s)")
    o.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                   help="write the summary as JSON")
    o.add_argument("--plots", type=Path, default=None, metavar="DIR",
                   help="write PNG plots (latency CDFs, throughput and 429s over time)")
    o.add_argument("--self-check", action="store_true",
                   help="measure TokenStorm's ceiling against a null server first")
    o.add_argument("--quiet", action="store_true", help="no live progress")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenstorm", description=MAN,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="send a load and report it", description=MAN,
                         epilog=RUN_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _run_args(run)
    ceil = sub.add_parser(
        "ceiling", help="TokenStorm's own ceiling against a null server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Starts the fast upstream with no latency (a null server) on a free "
                    "loopback port and runs a closed loop against it: the requests/s "
                    "reached is the most this machine's TokenStorm can offer with these "
                    "options. The null server shares the machine, so on a small box the "
                    "figure is a floor of the generator's true ceiling.")
    _common(ceil)
    ceil.add_argument("--concurrency", type=int, default=64, metavar="N",
                      help="requests in flight per worker (default: %(default)s)")
    ceil.add_argument("--duration", type=float, default=3.0, metavar="S",
                      help="seconds (default: %(default)s)")
    ceil.add_argument("--out", type=Path, default=None, metavar="FILE.json")
    up = sub.add_parser(
        "upstream", help="run the fast upstream (nginx + Lua, answers like vLLM 0.32)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs nginx in the foreground with vllm_like.lua: an OpenAI-compatible "
                    "server that answers exactly like vLLM 0.32 (bodies, SSE framing, "
                    "cumulative usage chunks, final usage chunk, error shapes) with "
                    "configurable TTFT and inter-token latency. Prompt tokens come from the "
                    "X-Token-Count request header (the gateway sets it); without it they are "
                    "estimated (ceil(bytes/4) + template overhead). Ctrl-C stops it.")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=38100)
    up.add_argument("--model", default=None, help="served model name (default: from config)")
    up.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS")
    up.add_argument("--ttft-ms", type=float, default=0.0, metavar="MS",
                    help="time to first token (default: %(default)s)")
    up.add_argument("--itl-ms", type=float, default=0.0, metavar="MS",
                    help="inter-token latency (default: %(default)s)")
    up.add_argument("--workers", type=int, default=1, help="nginx worker processes")
    up.add_argument("--prefix", type=Path, default=None, metavar="DIR",
                    help="folder of its rendered nginx.conf, pid, log and temp files "
                         "(default: var/run/fast-upstream-PORT in the working directory)")
    up.add_argument("--config", default=None, metavar="FILE")
    sim = sub.add_parser(
        "sim-replica", help="run a simulated vLLM replica with a real prefix cache",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs one simulated vLLM 0.32 replica in the foreground (Python, "
                    "uvicorn): it tokenizes prompts as vLLM does with the model "
                    "directory's own tokenizer and chat template, keeps a GPU's KV cache "
                    "with vLLM's prefix caching (blocks hashed as vLLM hashes them, LRU "
                    "eviction), reports prefix-cache hits as "
                    "usage.prompt_tokens_details.cached_tokens, publishes KV events in "
                    "vLLM's ZMQ wire format, and times each request: TTFT = prefill "
                    "queue wait + uncached tokens / --prefill-tokens-per-s + "
                    "--ttft-overhead-ms, then one token every --itl-ms; with --gpu it "
                    "steps as vLLM's scheduler instead, each step timed by a roofline of "
                    "the model on that GPU. Several of them "
                    "stand for a GPU fleet when routing by the prefix cache is measured. "
                    "Ctrl-C stops it.",
        epilog="EXAMPLE\n  tokenstorm sim-replica --port 38201 --num-gpu-blocks 4096 \\\n"
               "      --kv-events-endpoint tcp://127.0.0.1:5557\n"
               "  tokenstorm sim-replica --port 38202 --gpu h100 --model-config qwen3-8b "
               "--num-gpu-blocks 0")
    from tokenstorm.upstream import sim_settings

    sim_settings.add_arguments(sim)
    cap = sub.add_parser(
        "capacity", help="replicas needed for a request mix, rate and TPOT target",
        description="Prints how many replicas of --model-config on --gpu serve --rate "
                    "requests/s of --prompt prompt tokens (--cached of them in the prefix "
                    "cache) and --output completion tokens within --tpot-ms, each replica "
                    "kept --utilization busy. Each request costs the prefill of its "
                    "uncached tokens and its share of the largest decode batch within the "
                    "TPOT target (tokenstorm.upstream.roofline: the simulated replica's "
                    "step timing, checked against published vLLM numbers within 15 %%). "
                    "An estimate: `make bench-slo` measures a fleet.",
        epilog="EXAMPLE\n  tokenstorm capacity --model-config qwen3-8b --prompt 720 "
               "--output 1200 --rate 50 --tpot-ms 50",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from tokenstorm.upstream.roofline import GPUS

    cap.add_argument("--model-config", default="qwen3-8b", metavar="SHAPE|FILE",
                     help="qwen3-8b, qwen3-14b, llama-3-8b or a config.json "
                          "(default: %(default)s)")
    cap.add_argument("--gpu", choices=tuple(GPUS), default="h100")
    cap.add_argument("--prompt", type=int, required=True, metavar="TOKENS")
    cap.add_argument("--cached", type=int, default=0, metavar="TOKENS",
                     help="prompt tokens served from the prefix cache (default: 0)")
    cap.add_argument("--output", type=int, required=True, metavar="TOKENS")
    cap.add_argument("--rate", type=float, required=True, metavar="REQ_PER_S")
    cap.add_argument("--tpot-ms", type=float, default=50.0, metavar="MS",
                     help="time per output token target (default: %(default)s)")
    cap.add_argument("--utilization", type=float, default=0.8, metavar="X",
                     help="the busy share each replica is planned at (default: "
                          "%(default)s; the rest absorbs bursts)")
    cap.add_argument("--step-overhead-ms", type=float, default=2.0, metavar="MS")
    return p


def _resolve(args: argparse.Namespace) -> tuple[str, Path, int]:
    model, mdir, mlen = _defaults(args.config)
    model = args.model or model
    model_dir = args.model_dir or mdir
    if model_dir is None:
        sys.exit("tokenstorm: --model-dir is required (no model in the config)")
    return model, Path(model_dir), args.max_model_len or mlen


def _stream_opts(args: argparse.Namespace) -> StreamOptions:
    return StreamOptions(stream=args.stream, include_usage=not args.no_usage,
                         continuous_usage_stats=not args.no_continuous_usage,
                         ignore_eos=not args.no_ignore_eos)


def _sharing(args: argparse.Namespace) -> Sharing:
    return Sharing(tenants=args.tenants, prefix_tokens=args.shared_prefix_tokens,
                   conversations=args.conversations)


def _keys(args: argparse.Namespace) -> tuple[str, ...]:
    if args.api_key:
        return tuple(args.api_key)
    env = os.environ.get("TOKENSTORM_API_KEY")
    return (env,) if env else ()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in ("run", "ceiling", "upstream", "sim-replica", "capacity")
                    and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    args = parser().parse_args(argv)
    if args.command == "upstream":
        _upstream(args)
    elif args.command == "sim-replica":
        _sim_replica(args)
    elif args.command == "capacity":
        _capacity(args)
    elif args.command == "ceiling":
        sys.exit(_ceiling(args))
    else:
        sys.exit(_run(args))


def _upstream(args: argparse.Namespace) -> None:
    from tokenstorm import upstream

    model, _, mlen = _defaults(args.config)
    opts = upstream.UpstreamOptions(model=args.model or model,
                                    max_model_len=args.max_model_len or mlen,
                                    ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                                    workers=args.workers)
    prefix = args.prefix or Path("var") / "run" / f"fast-upstream-{args.port}"
    conf = upstream.render(opts, prefix.resolve(), args.port, args.host)
    print(f"fast upstream on http://{args.host}:{args.port}/v1 (model {opts.model}, "
          f"TTFT {opts.ttft_ms:g} ms, ITL {opts.itl_ms:g} ms); config {conf}", flush=True)
    cmd = upstream.argv(conf)
    os.execv(cmd[0], cmd)


def _capacity(args: argparse.Namespace) -> None:
    from tokenstorm.upstream import roofline

    try:
        r = roofline.Roofline(roofline.ModelShape.named(args.model_config),
                              roofline.GPUS[args.gpu], args.step_overhead_ms / 1000.0)
        if not 0 < args.utilization <= 1 or args.rate <= 0 or args.prompt < 1 \
                or args.output < 1 or not 0 <= args.cached < args.prompt:
            raise ValueError("--rate > 0, --prompt and --output >= 1, 0 <= --cached < "
                             "--prompt, 0 < --utilization <= 1")
        tpot = args.tpot_ms / 1000.0
        n, per = roofline.replicas_needed(r, args.rate, args.prompt, args.cached,
                                          args.output, tpot, args.utilization)
    except ValueError as e:
        sys.exit(f"tokenstorm capacity: {e}")
    batch = roofline.decode_batch(r, args.prompt + args.output // 2, tpot)
    print(f"{args.model_config} on one {args.gpu}: {per:.2f} requests/s of {args.prompt} "
          f"prompt ({args.cached} cached) + {args.output} completion tokens within TPOT "
          f"{args.tpot_ms:g} ms (decode batch {batch}); at {args.rate:g} requests/s and "
          f"{args.utilization:.0%} busy: {n} replicas")


def _sim_replica(args: argparse.Namespace) -> None:
    from tokenstorm.upstream import sim, sim_settings

    model, mdir, mlen = _defaults(args.config)
    if args.model_dir is None and mdir is None:
        sys.exit("tokenstorm sim-replica: --model-dir is required (no model in the config)")
    try:
        settings = sim_settings.settings_from_args(args, model, mdir or Path("."), mlen)
        settings.check()
    except ValueError as e:
        sys.exit(f"tokenstorm sim-replica: {e}")
    sim.serve(settings, args.host, args.port)


def _output(args: argparse.Namespace) -> OutputPolicy:
    return OutputPolicy(ratio=args.output_ratio, fixed=args.output_tokens,
                        max_output=args.max_output)


def measure_ceiling(args: argparse.Namespace, concurrency: int, duration_s: float,
                    console: Any = None) -> RunResult:
    """A closed loop of ``concurrency`` requests per worker for ``duration_s`` against a
    fresh null server, with ``args``' prompt, output and stream options."""
    from tokenstorm.null_server import FastUpstream
    from tokenstorm.runner import RunSpec, execute
    from tokenstorm.upstream import UpstreamOptions

    model, model_dir, mlen = _resolve(args)
    with FastUpstream(UpstreamOptions(model=model, max_model_len=mlen), name="null") as up:
        spec = RunSpec(url=up.url, model=model, model_dir=model_dir, max_model_len=mlen,
                       endpoint=args.endpoint, concurrency=concurrency, duration_s=duration_s,
                       profile=args.profile, sharing=_sharing(args), output=_output(args),
                       stream=_stream_opts(args), send_token_count=True,
                       workers=args.workers, timeout_s=args.timeout,
                       seed=args.seed, name="ceiling (null server)")
        return execute(spec, progress=console is not None, console=console)


def _ceiling(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenstorm import report

    console = Console()
    result = measure_ceiling(args, args.concurrency, args.duration, console)
    console.print(report.render(result.summary))
    console.print(f"[bold]TokenStorm ceiling: {result.summary.all.rps:,.0f} requests/s[/] "
                  f"({args.workers} worker(s), {args.concurrency} in flight each, "
                  f"{'stream' if args.stream else 'no stream'}, profile {args.profile})")
    if args.out:
        report.write_json(result.summary, args.out)
    return 0 if result.summary.all.ok else 1


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenstorm import report
    from tokenstorm.runner import RunSpec, execute

    console = Console()
    model, model_dir, mlen = _resolve(args)
    arrival = None
    concurrency = 0
    if args.concurrency:
        concurrency = args.concurrency
    else:
        rate = args.rate if args.rate is not None or args.token_rate is not None else 10.0
        try:
            arrival = ArrivalSpec(args.arrivals, rate=rate, token_rate=args.token_rate,
                                  burstiness=args.burstiness)
        except ValueError as e:
            console.print(f"tokenstorm: {e}")
            return 1
    try:
        spec = RunSpec(url=args.url, model=model, model_dir=model_dir, max_model_len=mlen,
                       endpoint=args.endpoint, arrival=arrival, concurrency=concurrency,
                       duration_s=args.duration, max_requests=args.max_requests,
                       profile=args.profile, sharing=_sharing(args), output=_output(args),
                       stream=_stream_opts(args), keys=_keys(args),
                       send_token_count=args.send_token_count,
                       check_prompt_tokens=not args.no_check_prompt_tokens,
                       workers=args.workers, connections=args.connections,
                       max_connections=args.max_connections, timeout_s=args.timeout,
                       seed=args.seed, max_lag_ms=args.max_lag_ms, slo=SLO.parse(args.slo),
                       name=args.name)
    except ValueError as e:
        console.print(f"tokenstorm: {e}")
        return 1
    if args.self_check:
        ceiling = measure_ceiling(args, 64, 3.0, console).summary.all.rps
        console.print(f"self-check: TokenStorm's ceiling with these options is "
                      f"[bold]{ceiling:,.0f} requests/s[/] against a null server")
        if arrival is not None and arrival.rate is not None and arrival.rate > 0.7 * ceiling:
            console.print(f"[yellow]warning: the target {arrival.rate:g} req/s is above 70 % "
                          "of the ceiling; add --workers or expect an invalid run[/]")
    try:
        result = execute(spec, progress=not args.quiet, console=console)
    except (RuntimeError, OSError) as e:
        console.print(f"tokenstorm: {e}")
        return 1
    console.print(report.render(result.summary))
    if args.out:
        report.write_json(result.summary, args.out)
        console.print(f"summary: {args.out}")
    if args.plots:
        for f in report.plot(result.records, result.summary, args.plots, args.name):
            console.print(f"plot: {f}")
    return 0 if result.summary.valid else 2


if __name__ == "__main__":
    main()
