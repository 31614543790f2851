"""tokengate.counter.chat_template's import of transformers: quiet about the absent
PyTorch (the base install has none on purpose), and about nothing else."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit


def test_tokengate_silences_only_the_advisory_that_pytorch_is_absent() -> None:
    # A base install has no torch on purpose; transformers' import then says "PyTorch was
    # not found ..." through logger.warning_advice on every `tokengate doctor` and
    # counter start. This venv has torch, so the advisory mechanism itself is checked:
    # after tokengate imports transformers an advisory is quiet and a warning is not.
    code = ("import os; from tokengate.counter import chat_template\n"
            "chat_template._transformers_renderer()\n"
            "from transformers.utils import logging\n"
            "log = logging.get_logger('transformers')\n"
            "log.warning_advice('an advisory'); log.warning('a warning')\n"
            "print(os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'])")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == \
        (0, "1\n", ["[transformers] a warning"])
