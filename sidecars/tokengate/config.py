"""The one YAML configuration (``tokengate.yaml``): models, API keys, limits.

Every sidecar and the edge read the same file; the edge reads a compiled JSON form
of it (see ``tokengate.tools.compile_config``). Relative paths are resolved against
the directory of the YAML file.

Shapes::

    models:
      <served model name>:
        dir: <model directory: tokenizer.json + tokenizer_config.json>
        vocab: auto | hf | qwen3.6
        max_model_len: <tokens>
        output_reserve: <tokens reserved when max_tokens is absent>
        max_tokens_cap: <tokens, optional server-side cap>
        upstream: <host:port of the vLLM server>
        cost: {input: <per 1M tokens>, output: <...>, cached: <...>}
    currency: USD
    keys:
      <key id>:
        sha256: <hex digest of the API key>
        rpm: <requests per minute>
        tpm: <tokens per minute>
        models: {<model>: {rpm: .., tpm: ..}}   # optional per-model overrides

Errors: ``ConfigError`` with the path of the offending field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "tokengate.yaml"
VOCABS = ("auto", "hf", "qwen3.6")


class ConfigError(ValueError):
    """The configuration file is invalid; the message names the field."""


@dataclass(frozen=True)
class ModelCost:
    """Billing weights, in the configured currency per 1M tokens."""

    input: float = 1.0
    output: float = 1.35
    cached: float = 0.1


@dataclass(frozen=True)
class ModelConfig:
    """One served model."""

    name: str
    dir: Path
    max_model_len: int
    output_reserve: int = 256
    max_tokens_cap: int | None = None
    vocab: str = "auto"
    upstream: str = "127.0.0.1:8000"
    cost: ModelCost = field(default_factory=ModelCost)


@dataclass(frozen=True)
class Limits:
    """Per-minute limits: requests (RPM) and tokens (TPM)."""

    rpm: int
    tpm: int


@dataclass(frozen=True)
class KeyConfig:
    """One API key, identified by ``id``; only its SHA-256 digest is stored."""

    id: str
    sha256: str
    limits: Limits
    model_limits: dict[str, Limits] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    """The whole configuration file, parsed and validated."""

    path: Path
    models: dict[str, ModelConfig]
    keys: dict[str, KeyConfig]
    currency: str = "USD"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _limits(raw: Any, where: str) -> Limits:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with rpm and tpm")
    return Limits(rpm=_int(raw.get("rpm"), f"{where}.rpm", 1),
                  tpm=_int(raw.get("tpm"), f"{where}.tpm", 1))


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the configuration.

    ``path`` defaults to ``$TOKENGATE_CONFIG`` or the repository's ``tokengate.yaml``.
    Raises ``ConfigError`` (naming the field) or ``OSError``.
    """
    p = Path(path or os.environ.get("TOKENGATE_CONFIG") or DEFAULT_CONFIG).resolve()
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    base = p.parent
    models: dict[str, ModelConfig] = {}
    for name, m in (raw.get("models") or {}).items():
        where = f"models.{name}"
        if not isinstance(m, dict) or "dir" not in m:
            raise ConfigError(f"{where}.dir: required")
        vocab = m.get("vocab", "auto")
        if vocab not in VOCABS:
            raise ConfigError(f"{where}.vocab: one of {', '.join(VOCABS)}, got {vocab!r}")
        cap = m.get("max_tokens_cap")
        cost = m.get("cost") or {}
        models[name] = ModelConfig(
            name=name,
            dir=(base / m["dir"]).resolve(),
            max_model_len=_int(m.get("max_model_len"), f"{where}.max_model_len", 1),
            output_reserve=_int(m.get("output_reserve", 256), f"{where}.output_reserve", 1),
            max_tokens_cap=None if cap is None else _int(cap, f"{where}.max_tokens_cap", 1),
            vocab=vocab,
            upstream=str(m.get("upstream", "127.0.0.1:8000")),
            cost=ModelCost(**{k: float(v) for k, v in cost.items()}),
        )
    keys: dict[str, KeyConfig] = {}
    for key_id, k in (raw.get("keys") or {}).items():
        where = f"keys.{key_id}"
        if not isinstance(k, dict):
            raise ConfigError(f"{where}: expected a mapping")
        digest = str(k.get("sha256", "")).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"{where}.sha256: expected 64 hex digits")
        per_model = {
            mname: _limits(ml, f"{where}.models.{mname}")
            for mname, ml in (k.get("models") or {}).items()
        }
        keys[key_id] = KeyConfig(key_id, digest, _limits(k, where), per_model)
    return Config(path=p, models=models, keys=keys,
                  currency=str(raw.get("currency", "USD")), raw=raw)
