"""``tokengate doctor``: is every upstream the vLLM that the counter mirrors, and does the
host run the services as the configuration says?

The checks are this package's: of each upstream (``tokengate.doctor.upstream``: health,
model, version, prompt_tokens_details, usage, tool_parser, the count probes;
``engine_records``; for prefix routing ``prefix``'s prefix_cache and kv_events; each
module's docstring says what it asks of vLLM) and of the host (``tokengate.doctor.host``);
this is the command that runs all of them and prints one line per check.
``tokengate-counter --check-upstreams`` runs the upstream checks as a process of its own
(``tokengate.doctor.preflight``): the counter never imports the doctor.
"""

from __future__ import annotations

import argparse
import sys

from tokengate import config as tg_config
from tokengate.doctor import host
from tokengate.doctor.check import summary
from tokengate.doctor.engine_records import ENGINE_WAIT_S
from tokengate.doctor.upstream import run, wait_healthy

DOCTOR_HELP = """\
Check every upstream of every model against what the counter and billing rely on:
/health; /v1/models serves the configured name and max_model_len; /version is a vLLM
release the counter was verified against (0.32.x); --enable-prompt-tokens-details is on
(usage.prompt_tokens_details present) and usage.prompt_tokens equals the counter's
count; the tool-call parser is on (a request with tools gets 200); the tokengate vLLM
plugin is loaded and writes where the ledger reads (that chat request's engine record
appears in one of ledger.engine_usage_files within --engine-wait-s); and for a fixed set
of bodies (system prompt, tools, multi-turn with a tool call, CJK, a completions prompt)
the counter's count equals vLLM's own POST /tokenize answer. For a model routed by the
prefix cache (routing.policy: prefix): vLLM's vllm:cache_config_info on /metrics says
prefix caching is on with the block size and hash algorithm of models.<name>.routing, and
each replica of routing.kv_events publishes, on that endpoint, the blocks of a probe
prompt with the counter's block hashes (which also checks routing.hash_seed). The counter
runs in this process from the configuration's model directories. Requests go straight to each
upstream (never through the edge); each generates at most one token.

Then the host: for an installed layout (/etc/tokengate/tokengate.yaml, units in
/etc/systemd/system), readable, each sidecar unit's own user and groups can read the
configuration and what it follows (the counter the models' files, the ledger the usage
and engine files' folders); the running services' own view, asked on their metrics
ports: kv_events_connected, the running counter is connected to the KV-event publisher
of each replica that routing.kv_events names (not only the doctor), and
engine_file_followed, the running ledger follows each of ledger.engine_usage_files;
and redis_persistence, the Redis of redis.url keeps its data across a restart
(appendonly yes; RDB snapshots alone are a warning, neither a failure: the bill, the
budgets' spend and the ledger's checkpoints live there).

OUTPUT
  One line per check per upstream, as it completes:
    <OK|WARN|FAIL|SKIP> <model> <host:port> <check>: <what was seen; what to change>
  then the host's, as "<STATUS> unit <unit> readable: ...", "<STATUS> counter
  <replica host:port> kv_events_connected: ...", "<STATUS> ledger <engine file>
  engine_file_followed: ..." and "<STATUS> redis <host:port> redis_persistence: ...",
  and a summary line on stderr.

EXIT STATUS
  0 every check passed (warnings allowed); 1 a check failed; 2 the configuration
  cannot be read or is invalid.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``tokengate doctor`` on the ``tokengate`` command's subparsers."""
    p = sub.add_parser("doctor", help="check that every upstream is the vLLM the counter "
                                      "mirrors", description=DOCTOR_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    tg_config.add_config_option(p)
    p.add_argument("--allow-unverified-vllm", action="store_true",
                   help="a vLLM release the counter was not verified against is a warning, "
                        "not a failure (the count checks still run and must pass)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="per request to an upstream, s (default: %(default)s)")
    p.add_argument("--engine-wait-s", type=float, default=ENGINE_WAIT_S,
                   help="how long a probe's engine record may take to appear in "
                        "ledger.engine_usage_files, s (default: %(default)s)")
    p.add_argument("--wait-s", type=float, default=0.0,
                   help="first wait up to this long for every upstream's /health, s "
                        "(default: %(default)s: no wait)")
    p.set_defaults(func=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    """``tokengate doctor``: 0 all passed, 1 a check failed, 2 bad configuration."""
    try:
        cfg = tg_config.load(args.config)
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tokengate doctor: {e}", file=sys.stderr)
        return 2

    def out(line: str) -> None:
        print(line, flush=True)

    if args.wait_s > 0:
        wait_healthy(cfg, args.wait_s, out)
    checks = run(cfg, allow_unverified=args.allow_unverified_vllm, timeout_s=args.timeout_s,
                 out=out, engine_records=True, engine_wait_s=args.engine_wait_s)
    host_checks = host.run(cfg)
    for c in host_checks:
        out(c.line())
    failed = any(c.status == "FAIL" for c in checks + host_checks)
    print(f"tokengate doctor: {summary(checks)}; host: "
          + ", ".join(f"{c.name} {c.status}" for c in host_checks), file=sys.stderr)
    return 1 if failed else 0
