"""Compile ``tokengate.yaml`` into the JSON the nginx edge reads (``lua/tokengate/config.lua``).

The edge loads the compiled file in ``init_by_lua`` (at start and on ``nginx -s reload``),
so the hot path never parses YAML or touches the model directory. The compiled form is a
flat, already-validated view of the YAML:

    {
      "version": 1,
      "source": "<absolute path of the YAML>",
      "models": {
        "<served model name>": {
          "max_model_len": <tokens>, "output_reserve": <tokens>,
          "max_tokens_cap": <tokens or null>, "default_max_tokens": <tokens or null>,
          "max_n": <most completions one request may ask for (n), default 8>,
          "host": "<IPv4/IPv6 literal>", "port": <int>, "upstream": "<host:port>",
          "special_tokens": ["<|im_start|>", ...]          # from the model's tokenizer
        }
      },
      "keys": {"<sha256 hex>": {"id": "<key id>", "rpm": <int>, "tpm": <int>,
                                "models": {"<model>": {"rpm": <int>, "tpm": <int>}}}},
      "edge": {... the ``edge`` section, defaults filled in, see ``EdgeConfig``},
      "global_limits": {"enabled": <bool>, "listen": "<host:port>",
                        "unix_socket": "<absolute path or null>"},
      "access_log": {"error_status": <status>, "slow_ms": <ms>, "slow_rate": <0..1>,
                     "rate": <0..1>, "file": "<absolute path, or '' when off>"}
    }

``access_log`` is the YAML's section (the rule is ``tokengate.ledger.sampling``'s) plus
``file``: where the edge writes the sampled lines, relative to the YAML's folder
(default ``var/log/access.sampled.log``; ``false`` or ``""`` turns the log off).

Usage: ``python -m tokengate.tools.compile_config --config tokengate.yaml --out edge.json``.
Errors: ``ConfigError`` naming the field (exit status 2 from the CLI).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokengate import config as tg_config
from tokengate.config import ConfigError

FAILURE_MODES = ("open", "closed")
SPECIAL_TOKEN_POLICIES = ("reject", "strip", "allow")
DEFAULT_MAX_N = 8  # completions per request (``n``): each costs a full output


@dataclass(frozen=True)
class EdgeConfig:
    """The ``edge`` section of tokengate.yaml (all optional).

    listen: ``host:port`` of the gateway (``make run``).
    max_body_bytes: largest request body, bytes (413 above it). The counter's gRPC
        limit is 64 MiB; vLLM's own is larger.
    max_json_depth: deepest JSON nesting accepted (400 above it).
    count_timeout_ms: how long the edge waits for the counter before failing open/closed.
    on_counter_failure: ``open`` forwards with a byte-length estimate
        (``X-Token-Count-Source: estimate``); ``closed`` answers 503.
    estimate_bytes_per_token: divisor of the fail-open estimate (bytes of the body per
        token; 3 over-counts English and matches CJK, so limits stay on the safe side).
    special_tokens: what to do with literal special-token strings (``<|im_end|>``) in the
        content, reasoning and tool calls (arguments, function names) of
        ``special_token_roles`` messages and in every string of ``tools`` (rendered into
        the system turn): ``reject`` (400), ``strip``, ``allow``.
    extra_special_tokens: more strings treated like the tokenizer's special tokens.
    count_cache_entries: per-worker LRU of counts of identical bodies.
    upstream_retry_after_s: ``Retry-After`` of a 502/503 for an unreachable backend.
    usage_file: the usage event file; default ``ledger.usage_file``.
    global_limits_timeout_ms: with ``global_limits.enabled``, how long admission waits for
        the global-limit sidecar before admitting on the local limits alone, ms. Above the
        sidecar's own Redis deadline (2 x ``redis.timeout_ms``) so a Redis outage arrives
        as UNAVAILABLE rather than as a timeout.
    global_limits_backoff_ms: after a failure of the global tier, requests skip it (local
        limits only) for this long, ms; then one request probes again.
    """

    listen: str = "127.0.0.1:8080"
    max_body_bytes: int = 4 << 20
    max_json_depth: int = 64
    count_timeout_ms: int = 500
    on_counter_failure: str = "open"
    estimate_bytes_per_token: int = 3
    special_tokens: str = "reject"
    special_token_roles: list[str] = field(
        default_factory=lambda: ["user", "assistant", "tool", "function"])
    extra_special_tokens: list[str] = field(default_factory=list)
    count_cache_entries: int = 4096
    upstream_retry_after_s: int = 5
    usage_file: str = ""
    global_limits_timeout_ms: int = 250
    global_limits_backoff_ms: int = 500


def _int(raw: dict[str, Any], name: str, default: int, minimum: int) -> int:
    v = raw.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"edge.{name}: expected an integer >= {minimum}, got {v!r}")
    return v


def _choice(raw: dict[str, Any], name: str, default: str, choices: tuple[str, ...]) -> str:
    v = raw.get(name, default)
    if v not in choices:
        raise ConfigError(f"edge.{name}: one of {', '.join(choices)}, got {v!r}")
    return str(v)


def _strings(raw: dict[str, Any], name: str, default: list[str]) -> list[str]:
    v = raw.get(name, default)
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ConfigError(f"edge.{name}: expected a list of non-empty strings")
    return list(v)


def edge_config(cfg: tg_config.Config) -> EdgeConfig:
    """The validated ``edge`` section of ``cfg`` with defaults; raises ``ConfigError``."""
    raw = cfg.raw.get("edge") or {}
    if not isinstance(raw, dict):
        raise ConfigError("edge: expected a mapping")
    d = EdgeConfig()
    usage = raw.get("usage_file")
    usage_path = (cfg.path.parent / str(usage)).resolve() if usage else cfg.ledger.usage_file
    return EdgeConfig(
        listen=str(raw.get("listen", d.listen)),
        max_body_bytes=_int(raw, "max_body_bytes", d.max_body_bytes, 1024),
        max_json_depth=_int(raw, "max_json_depth", d.max_json_depth, 4),
        count_timeout_ms=_int(raw, "count_timeout_ms", d.count_timeout_ms, 1),
        on_counter_failure=_choice(raw, "on_counter_failure", d.on_counter_failure,
                                   FAILURE_MODES),
        estimate_bytes_per_token=_int(raw, "estimate_bytes_per_token",
                                      d.estimate_bytes_per_token, 1),
        special_tokens=_choice(raw, "special_tokens", d.special_tokens,
                               SPECIAL_TOKEN_POLICIES),
        special_token_roles=_strings(raw, "special_token_roles", d.special_token_roles),
        extra_special_tokens=_strings(raw, "extra_special_tokens", d.extra_special_tokens),
        count_cache_entries=_int(raw, "count_cache_entries", d.count_cache_entries, 1),
        upstream_retry_after_s=_int(raw, "upstream_retry_after_s",
                                    d.upstream_retry_after_s, 1),
        usage_file=str(usage_path),
        global_limits_timeout_ms=_int(raw, "global_limits_timeout_ms",
                                      d.global_limits_timeout_ms, 1),
        global_limits_backoff_ms=_int(raw, "global_limits_backoff_ms",
                                      d.global_limits_backoff_ms, 0),
    )


DEFAULT_ACCESS_LOG = "var/log/access.sampled.log"


def access_log(cfg: tg_config.Config) -> dict[str, Any]:
    """The compiled ``access_log`` section: the sampling rule's settings
    (``cfg.access_log``) and the file, absolute ('' when off); raises ``ConfigError``."""
    raw = cfg.raw.get("access_log") or {}
    file = raw.get("file", DEFAULT_ACCESS_LOG) if isinstance(raw, dict) else DEFAULT_ACCESS_LOG
    if file is False or file == "":
        path = ""
    elif isinstance(file, str):
        path = str((cfg.path.parent / file).resolve())
    else:
        raise ConfigError(f"access_log.file: expected a path or false, got {file!r}")
    al = cfg.access_log
    return {"error_status": al.error_status, "slow_ms": al.slow_ms, "slow_rate": al.slow_rate,
            "rate": al.rate, "file": path}


def special_tokens(model_dir: Path) -> list[str]:
    """Literal strings of the tokenizer's special added tokens (``special: true``).

    Read from ``tokenizer.json`` (``added_tokens``) and, when present,
    ``tokenizer_config.json`` (``added_tokens_decoder``): the same files vLLM loads.
    Sorted longest first, so a strip pass removes ``<|im_end|>`` before any prefix of it.
    """
    found: set[str] = set()
    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        for tok in json.loads(tj.read_text()).get("added_tokens") or []:
            if tok.get("special") and tok.get("content"):
                found.add(tok["content"])
    tc = model_dir / "tokenizer_config.json"
    if tc.is_file():
        decoder = json.loads(tc.read_text()).get("added_tokens_decoder") or {}
        for tok in decoder.values():
            if isinstance(tok, dict) and tok.get("special") and tok.get("content"):
                found.add(tok["content"])
    return sorted(found, key=lambda s: (-len(s), s))


def _host_port(upstream: str, where: str) -> tuple[str, int]:
    """``host:port`` → (IP literal, port); host names are resolved once, here, because
    the edge's balancer takes addresses only."""
    host, sep, port = upstream.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"{where}: expected host:port, got {upstream!r}")
    host = host.strip("[]")
    try:
        addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ConfigError(f"{where}: cannot resolve {host!r}: {e}") from e
    return str(addr), int(port)


def compile_config(cfg: tg_config.Config) -> dict[str, Any]:
    """The edge's JSON document (shape in the module docstring) for ``cfg``."""
    edge = edge_config(cfg)
    models: dict[str, Any] = {}
    for name, m in cfg.models.items():
        raw = (cfg.raw.get("models") or {}).get(name) or {}
        dmt = raw.get("default_max_tokens")
        if dmt is not None and (isinstance(dmt, bool) or not isinstance(dmt, int) or dmt < 1):
            raise ConfigError(f"models.{name}.default_max_tokens: expected an integer >= 1")
        max_n = raw.get("max_n", DEFAULT_MAX_N)
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 1:
            raise ConfigError(f"models.{name}.max_n: expected an integer >= 1")
        host, port = _host_port(m.upstream, f"models.{name}.upstream")
        specials = special_tokens(m.dir) + [s for s in edge.extra_special_tokens]
        models[name] = {
            "max_model_len": m.max_model_len,
            "output_reserve": m.output_reserve,
            "max_tokens_cap": m.max_tokens_cap,
            "default_max_tokens": dmt,
            "max_n": max_n,
            "upstream": m.upstream,
            "host": host,
            "port": port,
            "special_tokens": sorted(set(specials), key=lambda s: (-len(s), s)),
        }
    keys: dict[str, Any] = {}
    for key_id, k in cfg.keys.items():
        if k.sha256 in keys:
            raise ConfigError(f"keys.{key_id}.sha256: same digest as keys."
                              f"{keys[k.sha256]['id']}")
        keys[k.sha256] = {
            "id": key_id, "rpm": k.limits.rpm, "tpm": k.limits.tpm,
            "models": {mn: {"rpm": lim.rpm, "tpm": lim.tpm}
                       for mn, lim in k.model_limits.items()},
        }
    gl = cfg.global_limits
    return {"version": 1, "source": str(cfg.path), "models": models, "keys": keys,
            "edge": asdict(edge),
            "global_limits": {"enabled": gl.enabled, "listen": gl.listen,
                              "unix_socket": str(gl.unix_socket) if gl.unix_socket else None},
            "access_log": access_log(cfg)}


def write(config_path: Path, out: Path) -> dict[str, Any]:
    """Load ``config_path``, compile it and write ``out`` atomically (rename), so a worker
    that starts during a reload never reads half a file. Returns the document."""
    doc = compile_config(tg_config.load(config_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return doc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tokengate.tools.compile_config",
        description="Compile tokengate.yaml into the JSON the nginx edge loads at start and "
                    "on reload. Run it, then `nginx -s reload`, after editing the YAML.")
    parser.add_argument("--config", type=Path, default=tg_config.DEFAULT_CONFIG,
                        help="YAML configuration (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    try:
        doc = write(args.config, args.out)
    except (OSError, ConfigError) as e:
        print(f"compile_config: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"compile_config: {len(doc['models'])} model(s), {len(doc['keys'])} key(s) "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
