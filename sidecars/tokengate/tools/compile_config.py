"""Compile ``tokengate.yaml`` into the JSON the nginx edge reads (``lua/tokengate/config.lua``).

The edge loads the compiled file in ``init_by_lua`` (at start and on ``nginx -s reload``),
so the hot path never parses YAML or touches the model directory. The document is the
schema's dump (``tokengate.config``, every default filled in, paths absolute) plus the
fields only the edge needs, derived here:

    {
      "version": 12,
      "source": "<absolute path of the YAML>",
      "models": {
        "<served model name>": {
          ... ``ModelConfig``: max_model_len, runner ("generate" | "pooling"),
          output_reserve, max_tokens_cap (or null), scheduling_policy ("fcfs" | "priority"),
          default_max_tokens (or null), cached_tokens_weight, max_n, embedded, dir, vocab, cost,
          idle_unload: {idle_s, max_hold_ms, retry_after_s, call_timeout_ms},
          routing: {policy ("least_outstanding" | "round_robin" | "prefix" | "slo"), block_size,
                    hash_algo, hash_seed, kv_events, load_weight} (tokengate.upstream
                    weighs outstanding tokens by load_weight against the prefix hit),
          "upstreams": [{"name": "<host:port as configured>", "host": "<host>",
                         "addr": "<IPv4/IPv6 literal resolved here, or null>",
                         "port": <int>, "resolve": <bool: a name, resolved again>}],
          "special_tokens": ["<|im_start|>", ...],          # tokenizer's + extra, longest first
          "structural_tokens": ["<tool_response>", ...]     # added, not special, in the
                                                            # chat template; longest first
        }
      },
      "keys": {"<sha256 hex>": {"id": "<key id>", "rpm": <int>, "tpm": <int>,
                                "models": {"<model>": {"rpm": <int>, "tpm": <int>}},
                                "allowed_models": ["<model>", ...] or null (every model),
                                "budgets": [{"period": "day" | "month",
                                             "spend": <currency> or null,
                                             "tokens": <int> or null,
                                             "model": "<model>" or null}],
                                "priority": "<a name in edge.admission.priorities>",
                                "max_tokens_cap": <int> or null (the model's),
                                "cached_tokens_weight": <0..1> or null (the model's),
                                "session_budget": {"tokens": <int> or null,
                                                   "spend": <currency> or null} or null,
                                "expires_at": <epoch s> or null (never),
                                "disabled": <bool>,
                                "previous": [{"sha256": "<hex>",
                                              "expires_at": <epoch s>}],
                                "levels": [{"level": "team" | "org", "name": "<name>",
                                            "id": "<level>:<name>",
                                            "rpm": <int> or null, "tpm": <int> or null,
                                            "budgets": [... as the key's]}]}},
                # levels: the key's team, then the team's organization
                # (tokengate.config.teams); allowed_models is the key's intersected
                # with theirs
      "edge": {... ``EdgeConfig``, usage_file absolute,
               "dns_servers": [["<address>", <port>], ...],       # see dns_servers()
               "auth_failures": {... ``AuthFailuresConfig``,
                                 "exempt_networks": [["<network address bytes, hex>",
                                                      <prefix length>], ...]}},
      "global_limits": {"enabled": <bool>, "listen": "<host:port>",
                        "unix_socket": "<absolute path or null>"},
      "access_log": {"error_status": <status>, "slow_ms": <ms>, "slow_rate": <0..1>,
                     "rate": <0..1>, "file": "<absolute path, or '' when off>"},
      "tracing": {... ``TracingConfig`` without headers},
      "currency": ..., "billing": {...}, "ledger": {...}
    }

``redis``, ``alerts`` and ``tracing.headers`` are left out: the edge never talks to Redis,
to a webhook or to a collector, and the URL, the secrets and the headers may carry
credentials. The edge reads
``tracing.enabled`` and ``tracing.sample_ratio`` (``lua/tokengate/trace.lua``).

Usage: ``python -m tokengate.tools.compile_config --config tokengate.yaml --out edge.json``.
Errors: ``ConfigError`` naming the key (exit status 2 from the CLI).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import sys
from pathlib import Path
from typing import Any

from tokengate import config as tg_config
from tokengate.config import ConfigError, EdgeConfig
from tokengate.counter.model_files import added_tokens, chat_template_source

__all__ = ["EdgeConfig", "compile_config", "edge_config", "special_tokens", "structural_tokens",
           "write"]

VERSION = 14  # 2: models carry structural_tokens; 3: upstreams (replicas) resolved;
#             4: keys carry allowed_models and budgets; 5: edge.admission and the keys'
#             priority; 6: models carry idle_unload; 7: edge.cors; 8: models carry
#             runner; 9: models carry routing; 10: edge.queue, models carry
#             max_concurrency, keys fair_share; 11: tracing; 12: keys carry
#             expires_at, disabled, previous (an old edge would admit a disabled key);
#             13: keys carry levels (an old edge would admit past a team's limits);
#             14: models carry scheduling_policy (an old edge would forward a
#             client's priority to replicas that honour it)


def edge_config(cfg: tg_config.Config) -> EdgeConfig:
    """The ``edge`` section of ``cfg`` (defaults filled in, ``usage_file`` absolute)."""
    return cfg.edge


def special_tokens(model_dir: Path) -> list[str]:
    """Literal strings of the tokenizer's special added tokens (``special: true``).

    Read from ``tokenizer.json`` (``added_tokens``) and, when present,
    ``tokenizer_config.json`` (``added_tokens_decoder``): the same files vLLM loads.
    Sorted longest first, so a strip pass removes ``<|im_end|>`` before any prefix of it.
    """
    return _by_length({t.content for t in added_tokens(model_dir) if t.special})


def structural_tokens(model_dir: Path) -> list[str]:
    """Added tokens that are not special but that the chat template writes itself, longest
    first (Qwen3: ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
    ``</tool_response>``, ``<think>``, ``</think>``; not ``<|fim_prefix|>``, which no turn
    uses).

    The tokenizer encodes each of them as its one added id wherever it appears, so a user
    who types ``</tool_response>`` produces exactly the ids the template uses to close a
    real tool response. Empty when the directory has no chat template.
    """
    source = chat_template_source(model_dir)
    if source is None:
        return []
    return _by_length({t.content for t in added_tokens(model_dir)
                       if not t.special and t.content in source})


def _replica(upstream: str, where: str, edge_resolves: bool) -> dict[str, Any]:
    """``host:port`` (checked by the schema) → the edge's replica entry {name, host, addr
    (IP literal, or None until the edge resolves it), port, resolve (the edge resolves the
    name again while running)}. The balancer takes addresses only. A name /etc/hosts
    gives is resolved here, once; with ``edge_resolves`` (``edge.dns_resolvers`` set)
    other names are left to the edge, else resolved here too. Raises ``ConfigError``
    for a name that does not resolve here."""
    host, _, port = upstream.rpartition(":")
    host = host.strip("[]")
    entry: dict[str, Any] = {"name": upstream, "host": host, "addr": None, "port": int(port),
                             "resolve": False}
    try:
        ipaddress.ip_address(host)
        return {**entry, "addr": host}
    except ValueError:
        pass
    if edge_resolves and host.lower() not in hosts_names():
        return {**entry, "resolve": True}
    try:
        addr = str(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0])
    except OSError as e:
        raise ConfigError(f"{where}: cannot resolve {host!r}: {e}") from e
    # a name the machine resolves (not from /etc/hosts) moves with its DNS record
    return {**entry, "addr": addr, "resolve": host.lower() not in hosts_names()}


def hosts_names(hosts: Path = Path("/etc/hosts")) -> set[str]:
    """The host names /etc/hosts lists (hosts(5)), lower-case; localhost always."""
    names = {"localhost"}
    try:
        lines = hosts.read_text().splitlines()
    except OSError:
        return names
    for line in lines:
        names.update(n.lower() for n in line.split("#", 1)[0].split()[1:])
    return names


def dns_servers(resolvers: list[str], resolv_conf: Path = Path("/etc/resolv.conf")
                ) -> list[list[Any]]:
    """The edge's DNS servers as [[address, port], ...]: ``edge.dns_resolvers``, else the
    ``nameserver`` lines of resolv.conf (port 53; resolv.conf(5)); [] when neither."""
    if resolvers:
        return [[h.strip("[]"), int(p)] for h, _, p in (r.rpartition(":") for r in resolvers)]
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return []
    return [[parts[1], 53] for parts in (line.split() for line in lines)
            if len(parts) >= 2 and parts[0] == "nameserver"]


def _by_length(tokens: set[str]) -> list[str]:
    return sorted(tokens, key=lambda s: (-len(s), s))


def _key(cfg: tg_config.Config, key_id: str, k: tg_config.KeyConfig) -> dict[str, Any]:
    """A key's entry: its settings, times as whole seconds since the epoch (the edge
    compares them with ``ngx.time()``), without the operators' free text (owner,
    description), which the edge never shows."""
    entry = {"id": key_id, **k.model_dump(mode="json",
                                          exclude={"sha256", "owner", "description"})}
    entry["expires_at"] = None if k.expires_at is None else int(k.expires_at.timestamp())
    entry["previous"] = [{"sha256": p.sha256, "expires_at": int(p.expires_at.timestamp())}
                         for p in k.previous]
    entry["levels"], allowed = [], k.allowed_models
    for level, name, g in tg_config.key_levels(k.team, cfg.teams, cfg.orgs):
        entry["levels"].append({"level": level, "name": name, "id": tg_config.level_id(level, name),
                                "rpm": g.rpm, "tpm": g.tpm,
                                "budgets": [b.model_dump(mode="json") for b in g.budgets]})
        if g.allowed_models is not None:
            allowed = [m for m in (allowed if allowed is not None else g.allowed_models)
                       if m in g.allowed_models]
    entry["allowed_models"] = allowed
    return entry


def compile_config(cfg: tg_config.Config) -> dict[str, Any]:
    """The edge's JSON document (shape in the module docstring) for ``cfg``.

    Raises ``ConfigError`` when a model's directory lacks the tokenizer files
    (``tokengate.config.check_model_dirs``) or an upstream host does not resolve.
    """
    tg_config.check_model_dirs(cfg)
    doc: dict[str, Any] = {"version": VERSION, "source": str(cfg.path),
                           **cfg.model_dump(mode="json",
                                            exclude={"redis": True, "alerts": True,
                                                     "tracing": {"headers"}})}
    extra = set(cfg.edge.extra_special_tokens)
    for name, m in cfg.models.items():
        edge_resolves = bool(cfg.edge.dns_resolvers)
        replicas = [_replica(u, f"models.{name}.upstreams.{i}", edge_resolves)
                    for i, u in enumerate(m.upstreams)]
        doc["models"][name].update(upstreams=replicas,
                                   special_tokens=_by_length(set(special_tokens(m.dir)) | extra),
                                   structural_tokens=structural_tokens(m.dir))
    # the edge looks a key up by the digest of the bearer token it was sent
    doc["keys"] = {k.sha256: _key(cfg, key_id, k) for key_id, k in cfg.keys.items()}
    doc["access_log"]["file"] = doc["access_log"]["file"] or ""
    doc["edge"]["dns_servers"] = dns_servers(cfg.edge.dns_resolvers)
    # the edge matches $binary_remote_addr, raw bytes: no address parsing in Lua
    af = doc["edge"]["auth_failures"]
    af["exempt_networks"] = [[n.network_address.packed.hex(), n.prefixlen]
                             for n in map(ipaddress.ip_network, af["exempt"])]
    return doc


def write(config_path: Path | None, out: Path) -> dict[str, Any]:
    """Load ``config_path`` (``tokengate.config.default_path()`` when None), compile it
    and write ``out`` atomically (rename), so a worker that starts during a reload never
    reads half a file; a file that is there keeps its owner, group and mode
    (``tokengate.config.write_atomic``). Returns the document. Raises ``ConfigError`` or
    ``OSError``."""
    doc = compile_config(tg_config.load(config_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: never Infinity or NaN for the edge's cjson (the schema refuses them)
    tg_config.write_atomic(out, json.dumps(doc, indent=1, ensure_ascii=False,
                                           allow_nan=False) + "\n")
    return doc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tokengate.tools.compile_config",
        description="Compile tokengate.yaml into the JSON the nginx edge loads at start and "
                    "on reload. Run it, then `nginx -s reload`, after editing the YAML.")
    tg_config.add_config_option(parser)
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
