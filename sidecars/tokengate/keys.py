"""``tokengate keys``: create, list, change and revoke API keys in ``tokengate.yaml``.

The file is edited with ruamel.yaml's round-trip mode, so its comments, order and layout
stay as the operator wrote them; the edited text is validated with the configuration
schema (``tokengate.config.loads``) and compiled for the edge before anything is
written, so an edit that would leave a broken file is refused and the file is left as it
was. A new key is ``tg-`` + 43 URL-safe random characters (256 bits), printed once;
only its SHA-256 digest is stored.

Applying: after writing, the file's own running edge (``edge_of``: an installed file's,
or ``make run``'s beside any other file; or each ``--edge``) gets the new configuration:
its compiled ``edge.json`` is written again (atomically, keeping its owner, group and
mode, like the YAML file) and its nginx master gets SIGHUP (what
``nginx -s reload`` sends). The command returns once every master runs new workers and
the old ones are shutting down (their listening sockets closed; streams in flight on
them continue): from then on a created key is admitted and a revoked one refused.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Self

import yaml
from redis.exceptions import RedisError
from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.scalarstring import SingleQuotedScalarString
from ruamel.yaml.tokens import CommentToken

from tokengate import config as tg_config
from tokengate.ledger import report
from tokengate.limits.budget import committed, counter_name
from tokengate.redis_client import SyncRedis, connect
from tokengate.tools import nginx_conf

KEY_PREFIX = "tg-"
RELOAD_TIMEOUT_S = 10.0
NGINX_PID = Path("/run/nginx.pid")  # Debian's nginx.conf: `pid /run/nginx.pid;`
# --budget: [MODEL:]PERIOD=AMOUNT, AMOUNT a currency amount or a token count ("2000000t")
BUDGET_SPEC = re.compile(r"^(?:(?P<model>[^:=]+):)?(?P<period>day|month)="
                         r"(?P<amount>\d+(?:\.\d+)?)(?P<tokens>t)?$")

KEYS_HELP = """\
Create, list, change and revoke API keys in tokengate.yaml, and apply the change to the
running edges at once (no restart; streams in flight continue).

  tokengate keys create NAME --rpm N --tpm N [--models a,b] [--budget SPEC]...
        prints the new key once (tg-...); the file stores only its SHA-256
  tokengate keys list [--json]
        names, limits, models, budgets and the spend of the current day / month
        (from the ledger's Redis: what `tokengate usage` reports, and what the budget
        counters hold with the reservations of requests in flight); never a key
  tokengate keys set NAME [--rpm N] [--tpm N] [--models a,b|all] [--budget SPEC]...
        [--no-budgets]
  tokengate keys revoke NAME
        removes the key: refused (401) once the command returns

  --budget [MODEL:]day=AMOUNT | [MODEL:]month=AMOUNT, AMOUNT in the configuration's
  currency (day=5.00) or in tokens with a t (month=2000000t); repeat it for several.
  A spend SPEC and a token SPEC of one model and period make one budget; `set
  --budget` sets that kind of the key's budget of that model and period (the other
  kind stays; --no-budgets first to drop it).

CONFIGURATION
  --config FILE, else $TOKENGATE_CONFIG, else the installed /etc/tokengate/tokengate.yaml
  where it exists (a checkout's ./tokengate.yaml only when named), else ./tokengate.yaml;
  a file not named is said on the first line (stderr). The file keeps its owner, group
  and mode (an install's is root:www-data 0640, read by the services through the group).

APPLYING
  The edges to reload are --edge DIR (a folder with edge.json and nginx.pid, as
  `make run` renders under var/run/nginx; repeatable), else the configuration's own
  edge when it runs: for an installed file (ROOT/etc/tokengate/tokengate.yaml, ROOT /
  or an install prefix) ROOT/etc/tokengate/edge.json with ROOT/run/nginx.pid; for any
  other file `make run`'s var/run/nginx beside it. Never both: a command acts on one
  deployment. --no-apply only writes the file.

EXIT STATUS
  0 done; 1 the edit is invalid (the file is unchanged; one line per problem) or an
  edge did not reload; 2 usage error, unknown key, or the file cannot be read.
"""


@dataclass(frozen=True)
class EdgeTarget:
    """A running edge: its compiled configuration and its nginx master's pid file."""

    edge_json: Path
    pid_file: Path


def new_key() -> str:
    """A new API key: ``tg-`` + 43 URL-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    """The SHA-256 hex digest the configuration stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_budget(spec: str) -> dict[str, Any]:
    """``[MODEL:]PERIOD=AMOUNT`` -> a ``Budget`` mapping (model, period, spend or tokens).
    Raises ``argparse.ArgumentTypeError``."""
    m = BUDGET_SPEC.match(spec)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected [MODEL:]day=AMOUNT or [MODEL:]month=AMOUNT (AMOUNT in the currency, "
            f"or tokens as 2000000t), got {spec!r}")
    out: dict[str, Any] = {"period": m["period"]}
    if m["model"]:
        out["model"] = m["model"]
    if m["tokens"]:
        if "." in m["amount"]:
            raise argparse.ArgumentTypeError(f"a token quota is a whole number: {spec!r}")
        out["tokens"] = int(m["amount"])
    else:
        out["spend"] = _Amount(m["amount"])
    return out


class _Amount(float):
    """A currency amount that the YAML file gets as it was typed (``0.00005``): ruamel
    writes floats by ``repr`` (``5e-05``), which YAML 1.1 readers (the configuration's
    loader) take for a string."""

    text: str

    def __new__(cls, text: str) -> Self:
        obj = super().__new__(cls, text)
        obj.text = text
        return obj


def _yaml() -> YAML:
    y = YAML()  # round-trip: comments, order and quoting are kept
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)  # the layout of the shipped tokengate.yaml
    # a whole amount ("5") as an integer, which the schema takes for a float: with the
    # float tag ruamel would write !!float '5'
    y.representer.add_representer(
        _Amount, lambda r, a: r.represent_scalar(
            "tag:yaml.org,2002:float" if "." in a.text else "tag:yaml.org,2002:int", a.text))
    return y


def _flow(items: list[str]) -> CommentedSeq:
    seq = CommentedSeq(items)
    seq.fa.set_flow_style()
    return seq


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One ``keys`` edit of ``path`` at a time (a lock file beside it)."""
    lock = path.with_name(f".{path.name}.lock")
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _merge_budgets(key: CommentedMap, budgets: list[dict[str, Any]]) -> None:
    """Add ``budgets`` to the key's list; one of the same model and period as a budget
    there sets that budget's spend limit or token quota (the other stays)."""
    current = key.get("budgets")
    if current is None:
        current = CommentedSeq()
        key["budgets"] = current
    for b in budgets:
        same = [old for old in current
                if old.get("period") == b["period"] and old.get("model") == b.get("model")]
        if same:
            same[0].update({k: v for k, v in b.items() if k in ("spend", "tokens")})
        else:
            current.append(CommentedMap(b))


def edit(path: Path, change: Any) -> tg_config.Config:
    """Apply ``change(data)`` (it edits the round-trip YAML data in place) to the file,
    validate the result and write it atomically. Returns the new configuration.
    Raises ``ConfigError`` (nothing written) or ``OSError``."""
    from tokengate.tools.compile_config import compile_config

    y = _yaml()
    with _locked(path):
        try:
            data = y.load(path.read_text())
        except YAMLError as e:
            raise tg_config.ConfigError(
                f"{path}: not YAML: {' '.join(str(e).split())[:300]}") from e
        change(data)
        buf = io.StringIO()
        y.dump(data, buf)
        text = buf.getvalue()
        cfg = tg_config.loads(text, path.resolve())
        compile_config(cfg)  # what the edge will load: upstreams resolve, tokenizer files
        tg_config.write_atomic(path, text)  # keeps the file's owner, group and mode
    return cfg


def installed_root(config_path: Path) -> Path | None:
    """The root folder of the install whose configuration ``config_path`` is
    (``<root>/etc/tokengate/tokengate.yaml``: ``/`` on a host, the prefix of ``tokengate
    install --prefix``), or None for any other file (a checkout's, ``make run``'s)."""
    p = config_path.resolve()
    if p.name == "tokengate.yaml" and p.parent.name == "tokengate" \
            and p.parent.parent.name == "etc":
        return p.parents[2]
    return None


def edge_of(config_path: Path) -> EdgeTarget:
    """The one edge a configuration file belongs to: an install's (``<root>/etc/
    tokengate/edge.json``, Debian nginx's ``<root>/run/nginx.pid``) for an installed
    file, else ``make run``'s (``var/run/nginx`` beside the file)."""
    root = installed_root(config_path)
    if root is not None:
        return EdgeTarget(nginx_conf.debian_paths(root)["edge_json"],
                          root / NGINX_PID.relative_to("/"))
    d = config_path.resolve().parent / "var" / "run" / "nginx"
    return EdgeTarget(d / "edge.json", d / "nginx.pid")


def find_edges(config_path: Path, dirs: list[Path]) -> list[EdgeTarget]:
    """The edges to reload: ``dirs`` (each with edge.json and nginx.pid), else the
    configuration's own edge (``edge_of``) when its pid file and edge.json exist. One
    deployment: a checkout's file never reaches an installed edge, nor the reverse."""
    if dirs:
        return [EdgeTarget(d / "edge.json", d / "nginx.pid") for d in dirs]
    own = edge_of(config_path)
    return [own] if own.pid_file.exists() and own.edge_json.exists() else []


def _workers(master: int) -> dict[int, str]:
    """The master's children: pid -> process title ("nginx: worker process", "nginx:
    worker process is shutting down", ...)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == master:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ") \
                    .decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


def reload_edge(target: EdgeTarget, cfg: tg_config.Config,
                timeout_s: float = RELOAD_TIMEOUT_S) -> None:
    """Compile ``cfg`` into the edge's edge.json, SIGHUP its master and wait until new
    workers serve and every old one is shutting down. Raises ``RuntimeError`` when the
    master is gone or did not reload in time (its error log says why)."""
    from tokengate.tools import compile_config

    try:
        master = int(target.pid_file.read_text().strip())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{target.pid_file}: no nginx master: {e}") from e
    compile_config.write(cfg.path, target.edge_json)
    old = {pid for pid, title in _workers(master).items() if "worker process" in title}
    try:
        os.kill(master, signal.SIGHUP)
    except OSError as e:
        raise RuntimeError(f"nginx master {master} ({target.pid_file}): {e}") from e
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _workers(master)
        fresh = [p for p, t in now.items() if p not in old and t.endswith("worker process")]
        still = [p for p in old if p in now and not now[p].endswith("shutting down")]
        if fresh and not still:
            return
        time.sleep(0.02)
    raise RuntimeError(f"nginx master {master} ({target.pid_file}) did not reload within "
                       f"{timeout_s:.0f} s: see its error log")


def apply(args: argparse.Namespace, cfg: tg_config.Config) -> int:
    """Reload every edge found; prints one line each. Returns the exit status."""
    if args.no_apply:
        return 0
    targets = find_edges(cfg.path, args.edge or [])
    if not targets:
        own = edge_of(cfg.path)
        print(f"no running edge of {cfg.path} ({own.pid_file} with {own.edge_json}; "
              "--edge DIR for another): nothing reloaded", file=sys.stderr)
        return 0
    status = 0
    for t in targets:
        try:
            reload_edge(t, cfg)
            print(f"applied: {t.edge_json} (nginx reloaded)", file=sys.stderr)
        except (RuntimeError, OSError, tg_config.ConfigError) as e:
            print(f"not applied: {e} (the file is as it is: reload that edge yourself)",
                  file=sys.stderr)
            status = 1
    return status


def _path(args: argparse.Namespace) -> Path:
    return Path(args.config if args.config is not None else tg_config.default_path())


def _cut(name: str, limit: int = 64) -> str:
    """``name`` cut after ``limit`` characters (a name typed or pasted by mistake can be
    any length; an error line shows its start and its length)."""
    return name if len(name) <= limit else f"{name[:limit]}... ({len(name)} characters)"


def shown(name: str) -> str:
    """A key id as a message quotes it (cut like ``_cut``)."""
    return repr(name) if len(name) <= 64 else f"{name[:64]!r}... ({len(name)} characters)"


def _name(name: str) -> Any:
    """A key id as the YAML file gets it: quoted where a YAML 1.1 reader (PyYAML)
    would take it for something else than a string (``yes``, ``off``, ``1_000``,
    ``12:30``), so the file means the same to any reader. Raises ``ConfigError`` for a
    name the key id rule refuses, the name cut."""
    if not tg_config.KEY_ID.fullmatch(name):
        raise tg_config.ConfigError(f"keys.{_cut(name)}: {tg_config.KEY_ID_RULE}")
    tag = yaml.resolver.Resolver().resolve(yaml.ScalarNode, name, (True, False))
    return name if tag == "tag:yaml.org,2002:str" else SingleQuotedScalarString(name)


def _keys(data: CommentedMap) -> CommentedMap:
    keys = data.get("keys")
    if keys is None:
        keys = CommentedMap()
        data["keys"] = keys
    return keys


def _last_item(node: Any) -> tuple[Any, Any] | None:
    """(container, key or index) of the last item of a block mapping or sequence, down
    through nested blocks: where ruamel.yaml keeps the comment lines that follow the
    block (for the last key of ``keys``: the next section's heading)."""
    found = None
    while isinstance(node, (CommentedMap, CommentedSeq)) and len(node) \
            and not node.fa.flow_style():
        at = next(reversed(node)) if isinstance(node, CommentedMap) else len(node) - 1
        found, node = (node, at), node[at]
    return found


def _take_trailing(node: Any) -> str | None:
    """Removes the comment lines that follow ``node``'s last line (its own end-of-line
    comment stays) and returns them, or None."""
    last = _last_item(node)
    if last is None:
        return None
    container, at = last
    slot = container.ca.items.get(at)
    token = slot[2] if slot and len(slot) > 2 else None
    if token is None or "\n" not in token.value:
        return None
    own, rest = token.value.split("\n", 1)
    if not rest.strip():
        return None
    token.value = own + "\n"
    return rest


def _put_trailing(node: Any, lines: str | None) -> None:
    """Puts comment ``lines`` (from ``_take_trailing``) after ``node``'s last line."""
    last = _last_item(node) if lines else None
    if last is None or lines is None:
        return
    container, at = last
    slot = container.ca.items.setdefault(at, [None, None, None, None])
    if slot[2] is None:
        slot[2] = CommentToken("\n" + lines, CommentMark(0), None)
    else:
        slot[2].value = slot[2].value.rstrip("\n") + "\n" + lines


def _models(text: str) -> list[str] | None:
    """``--models``: "all" -> None, else the names in order, each once; at least one."""
    if text == "all":
        return None
    names = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not names:
        raise argparse.ArgumentTypeError("name at least one model, or all")
    return names


def _combine(budgets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One command's --budget specs, a spend limit and a token quota of one model and
    period made one budget. Raises ``LookupError`` for two of one kind."""
    out: dict[tuple[str | None, str], dict[str, Any]] = {}
    for b in budgets:
        scope = (b.get("model"), b["period"])
        have = out.setdefault(scope, {})
        for kind in ("spend", "tokens"):
            if kind in b and kind in have:
                raise LookupError(f"--budget: two {b['period']} {kind} limits for "
                                  f"{b.get('model') or 'every model'}")
        have.update(b)
    return list(out.values())


def _keeping_heading(change: Any) -> Any:
    """``change``, with the comment lines after the last key (ruamel keeps the next
    section's heading on it) put after whichever key is last once it ran."""
    def changed(data: CommentedMap) -> None:
        keys = data.get("keys")
        trailing = _take_trailing(keys[next(reversed(keys))]) if keys else None
        change(data)
        keys = data.get("keys")
        if keys:
            _put_trailing(keys[next(reversed(keys))], trailing)
    return changed


def _run_edit(args: argparse.Namespace, change: Any) -> tuple[int, tg_config.Config | None]:
    try:
        return 0, edit(_path(args), _keeping_heading(change))
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        print(f"{_path(args)}: not changed", file=sys.stderr)
        return 1, None
    except LookupError as e:
        print(f"tokengate keys: {e.args[0]}", file=sys.stderr)
        return 2, None
    except OSError as e:
        print(f"tokengate keys: {e}", file=sys.stderr)
        return 2, None


def create(args: argparse.Namespace) -> int:
    """``tokengate keys create``: prints the new key on stdout (once)."""
    key = new_key()

    def change(data: CommentedMap) -> None:
        keys = _keys(data)
        name = _name(args.name)
        if args.name in keys:
            raise LookupError(f"key {shown(args.name)} exists (keys set, or keys revoke "
                              "first)")
        entry = CommentedMap(sha256=digest(key), rpm=args.rpm, tpm=args.tpm)
        if args.models is not None:
            entry["allowed_models"] = _flow(args.models)
        if args.budget:
            _merge_budgets(entry, _combine(args.budget))
        keys[name] = entry

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(key)
    print(f"created key {shown(args.name)}: the key above is shown only now", file=sys.stderr)
    return apply(args, cfg)


def set_(args: argparse.Namespace) -> int:
    """``tokengate keys set``: changes limits, models or budgets of a key."""

    def change(data: CommentedMap) -> None:
        keys = _keys(data)
        if args.name not in keys:
            raise LookupError(f"no key {shown(args.name)}")
        if (args.rpm, args.tpm, args.models, args.budget) == (None, None, None, None) \
                and not args.no_budgets:
            raise LookupError("nothing to change: give --rpm, --tpm, --models, --budget "
                              "or --no-budgets")
        entry = keys[args.name]
        if args.rpm is not None:
            entry["rpm"] = args.rpm
        if args.tpm is not None:
            entry["tpm"] = args.tpm
        if args.models is not None:
            if args.models == "all":
                entry.pop("allowed_models", None)
            else:
                try:
                    names = _models(args.models)
                except argparse.ArgumentTypeError as e:
                    raise LookupError(f"--models: {e}") from e
                entry["allowed_models"] = _flow(names or [])
        if args.no_budgets:
            entry.pop("budgets", None)
        if args.budget:
            _merge_budgets(entry, _combine(args.budget))

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(f"changed key {shown(args.name)}", file=sys.stderr)
    return apply(args, cfg)


def revoke(args: argparse.Namespace) -> int:
    """``tokengate keys revoke``: removes the key from the file."""

    def change(data: CommentedMap) -> None:
        keys = _keys(data)
        if args.name not in keys:
            raise LookupError(f"no key {shown(args.name)}")
        del keys[args.name]

    status, cfg = _run_edit(args, change)
    if cfg is None:
        return status
    print(f"revoked key {shown(args.name)}", file=sys.stderr)
    return apply(args, cfg)


def period_start(period: str, today: date) -> date:
    """First UTC day of the budget period holding ``today``."""
    return today if period == "day" else today.replace(day=1)


def listing(cfg: tg_config.Config, rows: list[report.UsageRow] | None,
            today: date, live: dict[tuple[str, str], tuple[int, int]] | None = None
            ) -> list[dict[str, Any]]:
    """``keys list --json``'s entries: per key its limits, models and budgets. Each
    budget has ``spent`` (currency) and ``tokens_used`` of the current period from
    ``rows`` (the ledger's per key / model / day rows: what ``tokengate usage`` bills;
    None: Redis unavailable, unknown), and ``committed_spend`` / ``committed_tokens``
    from ``live`` ((key id, counter) -> the budget counter in Redis, nano-units and
    tokens: billed plus reserved by requests in flight, what admission compares with the
    limit; None: unknown)."""
    out = []
    for key_id, k in cfg.keys.items():
        budgets = []
        for b in k.budgets:
            start = period_start(b.period, today).isoformat()
            entry: dict[str, Any] = {"period": b.period, "model": b.model, "spend": b.spend,
                                     "tokens": b.tokens, "since": start,
                                     "spent": None, "tokens_used": None,
                                     "committed_spend": None, "committed_tokens": None}
            if rows is not None:
                mine = [r for r in rows if r.key_id == key_id and (r.day or "") >= start
                        and (b.model is None or r.model == b.model)]
                entry["spent"] = round(sum(r.cost for r in mine), 9)
                entry["tokens_used"] = sum(r.prompt_tokens + r.completion_tokens
                                           for r in mine)
            counter = (key_id, counter_name(b.scope, b.period, today))
            if live is not None and counter in live:
                nano, tokens = live[counter]
                entry["committed_spend"] = nano / 1e9
                entry["committed_tokens"] = tokens
            budgets.append(entry)
        out.append({"name": key_id, "rpm": k.rpm, "tpm": k.tpm,
                    "allowed_models": k.allowed_models,
                    "models": {m: lim.model_dump() for m, lim in k.models.items()},
                    "priority": k.priority, "budgets": budgets})
    return out


def snapshot(cfg: tg_config.Config, client: SyncRedis | None,
             today: date) -> list[dict[str, Any]]:
    """``listing`` with what Redis holds now (``client``; None or a failing Redis: the
    spend is unknown, said on stderr): the ledger's rows of this month and, with global
    limits, the live budget counters. The admin endpoint (``tokengate.admin``) serves
    the same entries."""
    rows: list[report.UsageRow] | None = None
    live: dict[tuple[str, str], tuple[int, int]] | None = None
    counters = [(key_id, counter_name(b.scope, b.period, today))
                for key_id, k in cfg.keys.items() for b in k.budgets]
    if counters and client is not None:
        try:
            rows = report.query(client, since=today.replace(day=1))
            if cfg.global_limits.enabled:
                live = dict(zip(counters, committed(client, counters, list(cfg.models)),
                                strict=True))
        except (RedisError, OSError) as e:
            print(f"tokengate keys: Redis unavailable, spend unknown: {e}", file=sys.stderr)
    return listing(cfg, rows, today, live)


def admin(path: Path, client: SyncRedis) -> Callable[[str], tuple[int, Any] | None]:
    """The admin view that the ledger serves on its metrics port (``metrics.serve``):
    ``GET /keys`` -> ``{"currency", "keys": [entry...]}``, ``keys list --json``'s
    document; ``GET /keys/<name>`` -> that key's entry, or 404 ``{"error"}``. ``path``:
    the configuration file, read again whenever it changed (``tokengate keys`` edits
    it; a file that does not load leaves the last one that did)."""
    loaded: dict[str, Any] = {"stamp": None, "cfg": tg_config.load(path)}

    def current() -> tg_config.Config:
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != loaded["stamp"]:
                loaded["stamp"] = stamp
                loaded["cfg"] = tg_config.load(path)
        except (tg_config.ConfigError, OSError) as e:
            # once per change of the file
            print(f"tokengate admin view: {path} does not load, showing the last "
                  f"configuration that did: {' '.join(str(e).split())[:300]}",
                  file=sys.stderr, flush=True)
        cfg: tg_config.Config = loaded["cfg"]
        return cfg

    def answer(path_info: str) -> tuple[int, Any] | None:
        if path_info.rstrip("/") == "/keys":
            cfg = current()
            return 200, {"currency": cfg.currency,
                         "keys": snapshot(cfg, client, datetime.now(UTC).date())}
        if not path_info.startswith("/keys/"):
            return None
        name = path_info.removeprefix("/keys/")
        cfg = current()
        if name not in cfg.keys:
            return 404, {"error": f"no key named {name!r}"}
        entry = snapshot(cfg.model_copy(update={"keys": {name: cfg.keys[name]}}), client,
                         datetime.now(UTC).date())[0]
        return 200, {"currency": cfg.currency, **entry}
    return answer


def _amount(value: float) -> str:
    """A currency amount to the nano-unit budgets count in, without trailing zeros (as
    the edge writes it in a refusal)."""
    return f"{value:.9f}".rstrip("0").rstrip(".")


def list_(args: argparse.Namespace) -> int:
    """``tokengate keys list``: a table, or ``--json``."""
    try:
        cfg = tg_config.load(_path(args))
    except (tg_config.ConfigError, OSError) as e:
        print(f"tokengate keys: {e}", file=sys.stderr)
        return 2
    entries = snapshot(cfg, connect(cfg.redis, timeout_s=2.0, url=args.redis_url),
                       datetime.now(UTC).date())
    if args.json:
        json.dump({"currency": cfg.currency, "keys": entries}, sys.stdout, indent=1)
        print()
        return 0
    for entry in entries:
        models = ", ".join(entry["allowed_models"]) \
            if entry["allowed_models"] is not None else "all"
        print(f"{entry['name']}: rpm {entry['rpm']}, tpm {entry['tpm']}, models {models}")
        for m, lim in entry["models"].items():
            print(f"  {m}: rpm {lim['rpm']}, tpm {lim['tpm']}")
        for b in entry["budgets"]:
            scope = b["model"] or "all models"
            spent = "?" if b["spent"] is None else _amount(b["spent"])
            used = "?" if b["tokens_used"] is None else str(b["tokens_used"])
            parts = []
            if b["spend"] is not None:
                part = f"spend {spent} of {_amount(b['spend'])} {cfg.currency}"
                if b["committed_spend"] is not None:
                    part += f" ({_amount(b['committed_spend'])} with reservations)"
                parts.append(part)
            if b["tokens"] is not None:
                part = f"tokens {used} of {b['tokens']}"
                if b["committed_tokens"] is not None:
                    part += f" ({b['committed_tokens']} with reservations)"
                parts.append(part)
            print(f"  budget per {b['period']} ({scope}, since {b['since']}): "
                  + ", ".join(parts))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``keys`` on a ``tokengate`` subcommand parser."""
    p = sub.add_parser("keys", help="create, list, change and revoke API keys",
                       description=KEYS_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=None,
                        help="tokengate.yaml (default: $TOKENGATE_CONFIG, else the "
                             "installed /etc/tokengate/tokengate.yaml, else ./tokengate.yaml)")
    apply_opts = argparse.ArgumentParser(add_help=False)
    apply_opts.add_argument("--edge", type=Path, action="append", metavar="DIR",
                            help="an edge to reload: DIR holds edge.json and nginx.pid "
                                 "(repeatable; default: the ones found)")
    apply_opts.add_argument("--no-apply", action="store_true",
                            help="write the file only; reload nothing")
    verbs = p.add_subparsers(dest="verb", metavar="verb", required=True)
    c = verbs.add_parser("create", parents=[common, apply_opts], help="create a key")
    c.add_argument("name", help="key id (what usage events and reports show)")
    c.add_argument("--rpm", type=int, required=True, help="requests per minute")
    c.add_argument("--tpm", type=int, required=True, help="tokens per minute")
    c.add_argument("--models", type=_models, default=None, metavar="A,B",
                   help="the only models the key may use (default: all)")
    c.add_argument("--budget", type=parse_budget, action="append", metavar="SPEC",
                   help="[MODEL:]day=AMOUNT or [MODEL:]month=AMOUNT (AMOUNT in the "
                        "currency, or tokens: 2000000t); repeatable")
    c.set_defaults(func=create)
    s = verbs.add_parser("set", parents=[common, apply_opts], help="change a key")
    s.add_argument("name")
    s.add_argument("--rpm", type=int, default=None)
    s.add_argument("--tpm", type=int, default=None)
    s.add_argument("--models", default=None, metavar="A,B|all",
                   help="the only models the key may use; all: every model")
    s.add_argument("--budget", type=parse_budget, action="append", metavar="SPEC",
                   help="as for create; sets that kind (spend or tokens) of the budget of "
                        "that model and period")
    s.add_argument("--no-budgets", action="store_true",
                   help="remove the key's budgets (before adding --budget ones)")
    s.set_defaults(func=set_)
    r = verbs.add_parser("revoke", parents=[common, apply_opts], help="revoke a key")
    r.add_argument("name")
    r.set_defaults(func=revoke)
    ls = verbs.add_parser("list", parents=[common], help="list the keys (never the key)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--redis-url", default=None, help="Redis URL (default: redis.url)")
    ls.set_defaults(func=list_)
