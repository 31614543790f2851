"""Editing ``tokengate.yaml``'s keys in place: ruamel.yaml's round-trip mode keeps the
file's comments, order and layout as the operator wrote them.

``edit`` validates the edited text with the configuration schema
(``tokengate.config.loads``) and compiles it for the edge before anything is written, so
an edit that would leave a broken file is refused and the file is left as it was; the
write is atomic and keeps the file's owner, group and mode; one edit of a file runs at a
time (a lock file beside it). ``add_key``, ``change_key`` and ``remove_key`` are the
changes ``tokengate keys create|set|revoke`` make; each raises ``LookupError`` for a
request that does not fit the file (a key that exists, or does not).
"""

from __future__ import annotations

import argparse
import fcntl
import io
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Self

import yaml
from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.scalarstring import DoubleQuotedScalarString, SingleQuotedScalarString
from ruamel.yaml.tokens import CommentToken

from tokengate import config as tg_config
from tokengate.config.keys import timestamp

# --budget: [MODEL:]PERIOD=AMOUNT, AMOUNT a currency amount or a token count ("2000000t")
BUDGET_SPEC = re.compile(r"^(?:(?P<model>[^:=]+):)?(?P<period>day|month)="
                         r"(?P<amount>\d+(?:\.\d+)?)(?P<tokens>t)?$")

# a change of the round-trip YAML data, made in place
Change = Callable[[CommentedMap], None]


def parse_budget(spec: str) -> dict[str, Any]:
    """``[MODEL:]PERIOD=AMOUNT`` -> a ``Budget`` mapping (model, period, spend or tokens).
    Raises ``argparse.ArgumentTypeError``."""
    m = BUDGET_SPEC.match(spec)
    if not m and re.fullmatch(r"(?:[^:=]+:)?(?:day|month)=-.*", spec):
        raise argparse.ArgumentTypeError(f"a budget is not negative: {spec!r}")
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


# --session-budget: AMOUNT (spend, in the currency) or Nt (tokens)
SESSION_BUDGET_SPEC = re.compile(r"^(?P<amount>\d+(?:\.\d+)?)(?P<tokens>t)?$")


def parse_session_budget(spec: str) -> dict[str, Any]:
    """``AMOUNT`` | ``Nt`` -> ``{"spend": AMOUNT}`` | ``{"tokens": N}``, one kind of a
    ``SessionBudget``. Raises ``argparse.ArgumentTypeError``."""
    m = SESSION_BUDGET_SPEC.match(spec)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected AMOUNT (in the currency) or tokens as 200000t, got {spec!r}")
    if m["tokens"]:
        if "." in m["amount"]:
            raise argparse.ArgumentTypeError(f"a token budget is a whole number: {spec!r}")
        return {"tokens": int(m["amount"])}
    return {"spend": _Amount(m["amount"])}


def set_session_budget(data: CommentedMap, name: str, specs: list[dict[str, Any]] | None,
                       clear: bool = False) -> None:
    """The key's ``session_budget``: dropped with ``clear``, then each of ``specs``
    (``parse_session_budget``'s) sets its kind (the other kind stays). Raises
    ``LookupError`` for no such key."""
    keys = _keys(data)
    if name not in keys:
        raise LookupError(f"no key {shown(name)}")
    key = keys[name]
    if clear and "session_budget" in key:
        del key["session_budget"]
    if specs:
        current = key.get("session_budget")
        if current is None:
            current = CommentedMap()
            key["session_budget"] = current
        for spec in specs:
            current.update(spec)


class _Amount(float):
    """A currency amount that the YAML file gets as it was typed (``0.00005``): ruamel
    writes floats by ``repr`` (``5e-05``), which YAML 1.1 readers (the configuration's
    loader) take for a string."""

    text: str

    def __new__(cls, text: str) -> Self:
        obj = super().__new__(cls, text)
        obj.text = text
        return obj


def parse_models(text: str) -> list[str] | None:
    """``--models``: "all" -> None, else the names in order, each once; at least one."""
    if text == "all":
        return None
    names = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not names:
        raise argparse.ArgumentTypeError("name at least one model, or all")
    return names


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


def edit(path: Path, change: Change) -> tg_config.Config:
    """Apply ``change(data)`` (it edits the round-trip YAML data in place) to the file,
    validate the result and write it atomically. Returns the new configuration.
    Raises ``ConfigError`` (nothing written) or ``OSError``."""
    from tokengate.tools.compile_config import compile_config

    y = _yaml()
    with _locked(path):
        try:
            data = y.load(tg_config.read_text(path))
        except YAMLError as e:
            raise tg_config.ConfigError(
                f"{path}: not YAML: {' '.join(str(e).split())[:300]}") from e
        change(data)
        drop_expired(data, datetime.now(UTC))
        buf = io.StringIO()
        y.dump(data, buf)
        text = buf.getvalue()
        cfg = tg_config.loads(text, path.resolve())
        compile_config(cfg)  # what the edge will load: upstreams resolve, tokenizer files
        tg_config.write_atomic(path, text)  # keeps the file's owner, group and mode
    return cfg


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


def _combine(budgets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One command's --budget specs, a spend limit and a token quota of one model and
    period made one budget. Raises ``LookupError`` for two of one kind."""
    out: dict[tuple[str | None, str], dict[str, Any]] = {}
    for b in budgets:
        scope = (b.get("model"), b["period"])
        have = out.setdefault(scope, {})
        for kind in ("spend", "tokens"):
            if kind in b and kind in have:
                scope_text = (f"model {b['model']}" if b.get("model")
                              else "the whole key (every model)")
                raise LookupError(f"--budget: two {b['period']} {kind} limits for "
                                  f"{scope_text}")
        have.update(b)
    return list(out.values())


def keeping_heading(change: Change, section: str = "keys") -> Change:
    """``change``, with the comment lines after the last item of ``section`` (ruamel
    keeps the next section's heading on it) put after whichever item is last once it
    ran."""
    def changed(data: CommentedMap) -> None:
        node = data.get(section)
        trailing = _take_trailing(node) if node else None
        change(data)
        node = data.get(section)
        if node:
            _put_trailing(node, trailing)
    return changed


def add_key(data: CommentedMap, name: str, sha256: str, rpm: int, tpm: int,
            models: list[str] | None, budgets: list[dict[str, Any]] | None,
            priority: str | None = None, settings: dict[str, Any] | None = None) -> None:
    """``keys create``'s change: a key ``name`` with the digest ``sha256``, its limits
    (requests and tokens per minute), its only ``models`` (None: all), ``budgets``
    (``parse_budget``'s mappings) and admission ``priority`` (None: the default). Raises ``ConfigError`` for a name the key id rule
    refuses, ``LookupError`` when the key exists or two budgets are of one kind."""
    keys = _keys(data)
    yaml_name = _name(name)
    if name in keys:
        raise LookupError(f"key {shown(name)} exists (keys set, or keys revoke first)")
    entry = CommentedMap(sha256=sha256, rpm=rpm, tpm=tpm)
    if models is not None:
        entry["allowed_models"] = _flow(models)
    if budgets:
        _merge_budgets(entry, _combine(budgets))
    if priority is not None:
        entry["priority"] = priority
    _settle(entry, settings)
    keys[yaml_name] = entry


def _settle(entry: CommentedMap, settings: dict[str, Any] | None) -> None:
    """The key's other settings (``KeyConfig`` field -> value, e.g. max_tokens_cap,
    cached_tokens_weight) written into ``entry``; a value of None removes the field (the
    model's value applies again)."""
    for field, value in (settings or {}).items():
        if value is None:
            entry.pop(field, None)
        else:
            entry[field] = value


def change_key(data: CommentedMap, name: str, rpm: int | None, tpm: int | None,
               models: str | None, budgets: list[dict[str, Any]] | None,
               no_budgets: bool, priority: str | None = None,
               settings: dict[str, Any] | None = None) -> None:
    """``keys set``'s change of key ``name``: the limits given (None: as they are),
    ``models`` as ``--models`` has them ("all", or A,B; None: as they are), the
    budgets dropped with ``no_budgets`` and then ``budgets`` merged in, the admission
    ``priority`` (None: as it is), the other ``settings`` (``_settle``). Raises
    ``LookupError`` for no such key, nothing to change, a bad model list or two
    budgets of one kind."""
    keys = _keys(data)
    if name not in keys:
        raise LookupError(f"no key {shown(name)}")
    if (rpm, tpm, models, budgets, priority) == (None,) * 5 and not no_budgets \
            and not settings:
        raise LookupError("nothing to change: give --rpm, --tpm, --models, --budget, "
                          "--priority, --no-budgets, --max-tokens-cap, "
                          "--cached-tokens-weight, --expires-at, --owner or --description")
    entry = keys[name]
    if rpm is not None:
        entry["rpm"] = rpm
    if tpm is not None:
        entry["tpm"] = tpm
    if models is not None:
        if models == "all":
            entry.pop("allowed_models", None)
        else:
            try:
                names = parse_models(models)
            except argparse.ArgumentTypeError as e:
                raise LookupError(f"--models: {e}") from e
            entry["allowed_models"] = _flow(names or [])
    if no_budgets:
        entry.pop("budgets", None)
    if budgets:
        _merge_budgets(entry, _combine(budgets))
    if priority is not None:
        entry["priority"] = priority
    _settle(entry, settings)


def remove_key(data: CommentedMap, name: str) -> None:
    """``keys revoke``'s change: key ``name`` removed. Raises ``LookupError`` for no such
    key."""
    keys = _keys(data)
    if name not in keys:
        raise LookupError(f"no key {shown(name)}")
    del keys[name]


# --overlap, --expires-in: a number and a unit (s, m, h, d), or 0
DURATION = re.compile(r"^(?P<n>\d+)(?P<unit>[smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``24h``, ``7d`` or ``0`` -> a timedelta. Raises
    ``argparse.ArgumentTypeError``."""
    if text == "0":
        return timedelta(0)
    m = DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 30m, 24h or 7d, "
                                         f"got {text!r}")
    return timedelta(seconds=int(m["n"]) * _UNIT_S[m["unit"]])


def parse_time(text: str) -> datetime | None:
    """``--expires-at``: an RFC 3339 time with its offset -> an aware datetime; ``never``
    -> None. Raises ``argparse.ArgumentTypeError``."""
    if text == "never":
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        t = None
    if t is None or t.tzinfo is None:
        raise argparse.ArgumentTypeError(f"expected an RFC 3339 time with its offset such "
                                         f"as 2027-01-01T00:00:00Z, or never, got {text!r}")
    return t


def time_text(t: datetime) -> Any:
    """``t`` as the file gets it: RFC 3339 in UTC, quoted (a YAML reader would otherwise
    make a datetime of it, the same instant but no longer the text written)."""
    return DoubleQuotedScalarString(tg_config.rfc3339(t))


def _key(data: CommentedMap, name: str) -> CommentedMap:
    keys = _keys(data)
    if name not in keys:
        raise LookupError(f"no key {shown(name)}")
    entry: CommentedMap = keys[name]
    return entry


def rotate_key(data: CommentedMap, name: str, sha256: str, now: datetime,
               overlap: timedelta) -> datetime | None:
    """``keys rotate``'s change: the key's digest becomes ``sha256``; the one it replaces
    is kept in ``previous`` until ``now + overlap`` (none with an overlap of 0), so the
    tenant always holds a valid key. Returns that expiry (None: none kept). Raises
    ``LookupError`` for no such key."""
    entry = _key(data, name)
    old = entry["sha256"]
    entry["sha256"] = sha256
    if not overlap:
        return None
    until = now + overlap
    previous = entry.get("previous")
    if previous is None:
        previous = CommentedSeq()
        entry["previous"] = previous
    previous.append(CommentedMap(sha256=old, expires_at=time_text(until)))
    return until


def set_disabled(data: CommentedMap, name: str, disabled: bool) -> bool:
    """``keys disable`` / ``enable``: returns whether the key changed. Raises
    ``LookupError`` for no such key."""
    entry = _key(data, name)
    was = bool(entry.get("disabled", False))
    if disabled:
        entry["disabled"] = True
    else:
        entry.pop("disabled", None)
    return was != disabled


def drop_expired(data: CommentedMap, now: datetime) -> list[str]:
    """Every key's previous digests whose expiry has passed removed (the edge refuses
    them already); returns the ids of the keys that lost one."""
    dropped = []
    for name, entry in (data.get("keys") or {}).items():
        previous = entry.get("previous") if isinstance(entry, CommentedMap) else None
        if not previous:
            continue
        keep = []
        for p in previous:
            try:
                at = timestamp(p.get("expires_at"))
            except (ValueError, AttributeError):
                keep.append(p)  # the schema names what is wrong with it
                continue
            if at > now:
                keep.append(p)
        if len(keep) != len(previous):
            dropped.append(str(name))
            if keep:
                previous[:] = keep
            else:
                del entry["previous"]
    return dropped
