"""``tokengate_dev.build_tiny_model``: the embedded model's files, as a service user
(``tokengate-vllm@.service``, the counter) reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokengate_dev import build_tiny_model

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit


def test_the_built_model_is_readable_by_every_user(tmp_path: Path) -> None:
    out = tmp_path / "tiny-qwen3"
    build_tiny_model.build(out)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert modes == {name: "0o644" for name in (
        ".complete", "config.json", "generation_config.json", "merges.txt",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json")}
    assert oct(out.stat().st_mode & 0o777) == "0o755"
