"""The key forms' fields checked one by one, each with a message the page shows beside
the field, before anything reaches the file: a form that fails here changes nothing.
What only the whole file can tell (a budget without global limits, a model a budget
names that the key may not use) is refused by the schema in ``tokengate.keys.edit``
and shown the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokengate import config as tg_config
from tokengate.console.changes import KeyChange
from tokengate.keys.edit import parse_budget

MAX_FIELD = 2000            # characters of any field
MAX_BUDGETS = 20
SPLIT = re.compile(r"[\s,;]+")


@dataclass
class Checked:
    """A form's values as typed (to show them again) and a message per bad field."""

    values: dict[str, str]
    errors: dict[str, str] = field(default_factory=dict)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"


def _count(c: Checked, name: str, what: str, required: bool) -> int | None:
    text = c.values.get(name, "").strip()
    if not text:
        if required:
            c.errors[name] = f"required: {what}"
        return None
    if not text.isdigit() or not text.isascii():
        c.errors[name] = f"{_shown(text)} is not a whole number: {what}"
        return None
    n = int(text) if len(text) <= 15 else tg_config.MAX_COUNT + 1
    if not 1 <= n <= tg_config.MAX_COUNT:
        c.errors[name] = f"{what}: from 1 to {tg_config.MAX_COUNT:,}"
        return None
    return n


def _models(c: Checked, cfg: tg_config.Config) -> str | None:
    text = c.values.get("models", "").strip()
    if not text or text == "all":
        return "all"
    names = [m for m in SPLIT.split(text) if m]
    unknown = [m for m in names if m not in cfg.models]
    if unknown:
        c.errors["models"] = (f"not a served model: {', '.join(_shown(m) for m in unknown[:3])}"
                              f" (served: {', '.join(cfg.models)}; empty: all)")
        return None
    return ",".join(dict.fromkeys(names))


def _budgets(c: Checked) -> tuple[str, ...] | None:
    specs = [s for s in SPLIT.split(c.values.get("budgets", "").strip()) if s]
    if len(specs) > MAX_BUDGETS:
        c.errors["budgets"] = f"at most {MAX_BUDGETS} budgets"
        return None
    for s in specs:
        try:
            parse_budget(s)
        except argparse.ArgumentTypeError as e:
            c.errors["budgets"] = str(e)
            return None
    return tuple(specs)


def _priority(c: Checked, cfg: tg_config.Config) -> str | None:
    text = c.values.get("priority", "").strip()
    if text and text not in cfg.edge.admission.priorities:
        c.errors["priority"] = (f"{_shown(text)} is not one of "
                                f"{', '.join(cfg.edge.admission.priorities)}")
        return None
    return text or None


def _values(form: Mapping[str, str], names: tuple[str, ...]) -> Checked:
    c = Checked({n: form.get(n, "") for n in names})
    for n, v in c.values.items():
        if len(v) > MAX_FIELD:
            c.errors[n] = f"too long: {len(v):,} characters (at most {MAX_FIELD:,})"
            c.values[n] = v[:MAX_FIELD]
    return c


CREATE_FIELDS = ("name", "rpm", "tpm", "models", "budgets", "priority")
SET_FIELDS = ("rpm", "tpm", "models", "budgets", "priority")


def _key_fields(c: Checked, cfg: tg_config.Config) -> dict[str, Any]:
    """The fields that creating and changing a key share, read from ``c`` (each one whose
    value did not arrive well formed is None, its message in ``c.errors``): rpm, tpm,
    models, budgets (None for none) and priority, as ``KeyChange`` takes them."""
    rpm = _count(c, "rpm", "requests per minute", True) if "rpm" not in c.errors else None
    tpm = _count(c, "tpm", "tokens per minute", True) if "tpm" not in c.errors else None
    models = _models(c, cfg) if "models" not in c.errors else None
    budgets = _budgets(c) if "budgets" not in c.errors else None
    priority = _priority(c, cfg) if "priority" not in c.errors else None
    return {"rpm": rpm, "tpm": tpm, "models": models, "budgets": budgets or None,
            "priority": priority}


def create(form: Mapping[str, str], cfg: tg_config.Config,
           sha256: str) -> tuple[KeyChange | None, Checked]:
    """The create form -> (the change, or None with the messages)."""
    c = _values(form, CREATE_FIELDS)
    name = c.values["name"].strip()
    if "name" not in c.errors:
        if not name:
            c.errors["name"] = "required: the key's id (what reports show)"
        elif not tg_config.KEY_ID.fullmatch(name):
            c.errors["name"] = f"{_shown(name)}: {tg_config.KEY_ID_RULE}"
        elif name in cfg.keys:
            c.errors["name"] = f"a key named {name!r} exists: change it, or revoke it first"
    fields = _key_fields(c, cfg)
    if c.errors:
        return None, c
    return KeyChange("create", name, sha256=sha256, **fields), c


def set_(form: Mapping[str, str], cfg: tg_config.Config,
         name: str) -> tuple[KeyChange | None, Checked]:
    """The change form of key ``name`` -> (the change, or None with the messages). The
    form shows every value: rpm, tpm, models and priority are set as given, the
    budgets replace the key's (empty: none). The form's ``version`` (required) and
    ``shown`` (the values it showed, JSON) go with the change: a key changed since is
    not overwritten (``changes.Stale``)."""
    c = _values(form, SET_FIELDS)
    version = form.get("version", "")
    if not re.fullmatch(r"[0-9a-f]{64}", version):
        c.errors["version"] = ("this form has no version of the key it showed: reload "
                               "the page and make the change again")
    try:
        shown = json.loads(form.get("shown", "") or "null")
    except ValueError:
        shown = None
    if not isinstance(shown, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in shown.items()):
        shown = None
    fields = _key_fields(c, cfg)
    if c.errors:
        return None, c
    return KeyChange("set", name, no_budgets=True, version=version, shown=shown,
                     **fields), c


def form_values(key: tg_config.KeyConfig) -> dict[str, str]:
    """What the change form shows of ``key`` and a save writes back, field by field
    (rpm, tpm, models, budgets, priority), as text."""
    return {"rpm": str(key.rpm), "tpm": str(key.tpm),
            "models": ", ".join(key.allowed_models) if key.allowed_models else "",
            "budgets": budget_specs(key), "priority": key.priority}


def key_version(values: Mapping[str, str]) -> str:
    """The version of a key's settings that a form carries: SHA-256 (hex) of
    ``form_values``' JSON. Only what the form writes back counts: a change of another
    setting (a rotated secret) cannot be undone by the save, so it does not stale it."""
    text = json.dumps(dict(values), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def budget_specs(key: tg_config.KeyConfig) -> str:
    """A key's budgets as the form shows them: ``--budget`` specs, one per line."""
    out = []
    for b in key.budgets:
        scope = f"{b.model}:" if b.model else ""
        if b.spend is not None:
            out.append(f"{scope}{b.period}={b.spend:.9f}".rstrip("0").rstrip("."))
        if b.tokens is not None:
            out.append(f"{scope}{b.period}={b.tokens}t")
    return "\n".join(out)
