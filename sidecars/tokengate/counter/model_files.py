"""The served model's own files, read the way transformers (and so vLLM) reads them.

Kept free of heavy imports: the edge's config compiler reads the same files as the counter
(``tokengate.tools.compile_config``: special and structural tokens) and runs on every
nginx start and reload.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class AddedToken:
    """One added token of the tokenizer: its literal text and whether it is special."""

    content: str
    special: bool


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def chat_template_source(model_dir: Path) -> str | None:
    """The chat template text: ``chat_template.jinja`` when present, else
    ``tokenizer_config.json``'s ``chat_template`` (of a list of named templates, the one
    named "default"), as transformers' tokenizer loading picks it; None when the directory
    defines none."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    source = _json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    return source if isinstance(source, str) else None


def added_tokens(model_dir: Path) -> list[AddedToken]:
    """The tokenizer's added tokens, from ``tokenizer.json`` (``added_tokens``) and
    ``tokenizer_config.json`` (``added_tokens_decoder``); a token listed in both is special
    when either says so. Every one of them is matched as a whole token in raw text by HF
    tokenizers (special or not), which is what lets a literal one forge structure.

    Remembered per state of the two files (size and modification time): tokenizer.json
    is large (Qwen3's: 11 MB, about 0.2 s to parse) and the edge's config compiler asks
    twice per compile, on every nginx start and reload."""
    files = (model_dir / "tokenizer.json", model_dir / "tokenizer_config.json")
    stamp = tuple((st.st_size, st.st_mtime_ns) if (st := _stat(f)) else None for f in files)
    return list(_added_tokens(model_dir, stamp))


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _added_tokens(model_dir: Path, _stamp: tuple[Any, ...]) -> tuple[AddedToken, ...]:
    found: dict[str, bool] = {}
    entries: list[Any] = list(_json(model_dir / "tokenizer.json").get("added_tokens") or [])
    entries += list((_json(model_dir / "tokenizer_config.json")
                     .get("added_tokens_decoder") or {}).values())
    for tok in entries:
        if isinstance(tok, dict) and isinstance(tok.get("content"), str) and tok["content"]:
            found[tok["content"]] = found.get(tok["content"], False) or bool(tok.get("special"))
    return tuple(AddedToken(c, s) for c, s in found.items())


# vLLM's get_sentence_transformer_tokenizer_config (vllm/transformers_utils/config.py):
# the first of these files in the model's directory that holds max_seq_length is the
# model's encoder_config.
SENTENCE_TRANSFORMER_CONFIGS = (
    "sentence_bert_config.json", "sentence_roberta_config.json",
    "sentence_distilbert_config.json", "sentence_camembert_config.json",
    "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)


def encoder_do_lower_case(model_dir: Path) -> bool:
    """Whether vLLM lower-cases a pooling request's text before tokenizing it: the
    ``do_lower_case`` of the model's sentence-transformers configuration
    (``ModelConfig.encoder_config``, read into ``TokenizeParams.do_lower_case`` by
    vllm/entrypoints/pooling/base/protocol.py ``_build_pooling_tok_params``). vLLM takes
    the first of ``SENTENCE_TRANSFORMER_CONFIGS`` that is a non-empty object, and uses
    it only when it holds ``max_seq_length``; False without one."""
    for name in SENTENCE_TRANSFORMER_CONFIGS:
        conf = _json(model_dir / name)
        if conf:
            return "max_seq_length" in conf and bool(conf.get("do_lower_case", False))
    return False
