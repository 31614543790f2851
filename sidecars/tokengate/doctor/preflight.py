"""The upstream checks of ``tokengate-counter --check-upstreams``, run by the counter as a
process of its own before it serves: ``python -m tokengate.doctor.preflight --config FILE
[--allow-unverified-vllm] [--wait-s S]``.

The checks are the doctor's (``tokengate.doctor.upstream``) but for ``engine_records``,
the ledger's concern. They run in a child process because the doctor is an operator's
tool that loads every model's counter in its own process: a service never imports the
layer above it (tests/deploy/test_layers.py), and the counter's parent stays as small as
it is without the check. Prints each ``Check.line()`` and then the summary, one per line
on stdout, and exits 1 when a check failed (0 otherwise, 2 when the configuration does
not load).
"""

from __future__ import annotations

import argparse
import sys

from tokengate import config as tg_config
from tokengate.doctor.check import summary
from tokengate.doctor.upstream import run, wait_healthy


def main(argv: list[str] | None = None) -> int:
    """The checks of every upstream of ``--config``; the exit status as the module says."""
    parser = argparse.ArgumentParser(prog="python -m tokengate.doctor.preflight",
                                     description=__doc__)
    parser.add_argument("--config", required=True, help="tokengate.yaml")
    parser.add_argument("--allow-unverified-vllm", action="store_true",
                        help="a vLLM release the counter was not verified against warns")
    parser.add_argument("--wait-s", type=float, default=0.0,
                        help="first wait up to this long for every upstream's /health, s")
    args = parser.parse_args(argv)
    cfg = tg_config.load_or_exit(parser, args.config)

    def out(line: str) -> None:
        print(line, flush=True)

    if args.wait_s > 0:
        wait_healthy(cfg, args.wait_s, out)
    checks = run(cfg, allow_unverified=args.allow_unverified_vllm, out=out)
    out(summary(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
