"""``tokengate ARGS`` run in the test's own process (``tokengate.cli.main``), with what
``subprocess.run`` would report: a command line of its own costs a Python start and the
imports of config, Redis and the command (0.5-2.5 CPU-s a call; test_keys.py alone made
~40 calls). Tests of what only a process shows (the console script, exit on SIGPIPE, the
unit's user) still start one.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tokengate import cli as tokengate_cli


def tokengate(*args: str | Path, stdin: str | None = None
              ) -> subprocess.CompletedProcess[str]:
    """``tokengate ARGS`` in this process (``stdin``: what it reads): its exit status,
    stdout and stderr as ``subprocess.run(..., capture_output=True, text=True)`` gives
    them (``sys.exit("message")``: the message on stderr, status 1)."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            _stdin(io.StringIO(stdin or "")):
        try:
            tokengate_cli.main(argv)
        except SystemExit as done:
            code = done.code
    if isinstance(code, str):
        err.write(code + "\n")
    status = code if isinstance(code, int) else int(code is not None)
    return subprocess.CompletedProcess(["tokengate", *argv], status, out.getvalue(),
                                       err.getvalue())


@contextlib.contextmanager
def _stdin(text: io.StringIO) -> Iterator[None]:
    saved, sys.stdin = sys.stdin, text
    try:
        yield
    finally:
        sys.stdin = saved
