"""The configuration reference (``docs/config.md``), rendered from the schema's JSON Schema.

One table per section, in the schema's order: every key with its type, default and
description. ``tokengate config docs --out docs/config.md`` writes it; a test fails when
the committed file differs, so the reference cannot drift from ``tokengate.config``.
"""

from __future__ import annotations

import json
from typing import Any

from tokengate.config import Config

# what a map's keys stand for, by the map's own key
PLACEHOLDERS = {"models": "<model>", "keys": "<key id>"}

INTRO = """\
# tokengate.yaml reference

Generated from the schema in `tokengate.config` by
`tokengate config docs --out docs/config.md`: do not edit by hand.
`tokengate config check FILE` validates a file against it (exit status 1 and one line per
problem, each starting with the key's dotted path); `tokengate config schema` prints the
JSON Schema, for editors.

Every key is optional unless marked *required*; an unknown key is an error, never
ignored. Relative paths are relative to the folder of the YAML file. Units: token counts
in tokens, `*_ms` in milliseconds, `*_s` in seconds, prices in `currency` per 1M tokens.
Every number is finite (`.inf` and `.nan` are refused) and bounded by what the edge's
Lua numbers, the sidecars' uint64 messages and Redis hold: counts and durations (tokens,
requests, bytes, entries, ms, s) are at most 1000000000000 (1e12: `rpm`, `tpm` and token
quotas included, from the file through limits.proto to Redis), amounts of the currency
(prices, a budget's `spend`) at most 1000000000 (1e9: spend is counted in integer
nano-units, 1e18 of them); a key's limits are enforced exactly up to these bounds.
The default file is `$TOKENGATE_CONFIG`, else the installed
`/etc/tokengate/tokengate.yaml` where it exists (a checkout's file is then used only when
named), else `./tokengate.yaml`; a `tokengate` command says on stderr which file it used
when it was not named (`--verbose`: always).
"""


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``tokengate.yaml``."""
    schema = Config.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "tokengate.yaml", **{k: v for k, v in schema.items() if k != "title"}}


class _Renderer:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.defs: dict[str, Any] = schema.get("$defs", {})
        self.sections: list[str] = []

    def deref(self, node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        return self.defs[ref.rsplit("/", 1)[1]] if ref else node

    def type_of(self, node: dict[str, Any]) -> str:
        node = self.deref(node)
        if "anyOf" in node:
            return " or ".join(self.type_of(n) for n in node["anyOf"])
        if "const" in node:
            return f"`{json.dumps(node['const'])}`"
        if "enum" in node:
            return " \\| ".join(f"`{v}`" for v in node["enum"])
        kind = node.get("type")
        if kind == "array":
            return f"list of {self.type_of(node.get('items', {}))}"
        if kind == "object":
            # a map of scalars (its keys by pattern): "map of host:port to tcp://host:port"
            values = list(node.get("patternProperties", {}).values())
            if len(values) == 1 and "properties" not in self.deref(values[0]):
                keys = node.get("propertyNames", {}).get("format", "string")
                return f"map of {keys} to {self.type_of(values[0])}"
            return "section"
        if kind in ("integer", "number"):
            lo, hi = node.get("minimum"), node.get("maximum")
            if lo is not None and hi is not None:
                return f"{kind} {lo}..{hi}"
            if lo is not None:
                return f"{kind} >= {lo}"
            return str(kind)
        if kind == "string" and node.get("format"):
            return str(node["format"])
        return str(kind or "any")

    def section(self, path: str, node: dict[str, Any], required: bool = False) -> None:
        node = self.deref(node)
        lines = [f"## `{path}`" if path else "## Top level", ""]
        if path:  # the top level's is the module's business, the intro says it
            for para in (node.get("description") or "").split("\n\n"):
                lines += [" ".join(para.split()), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        nested: list[tuple[str, dict[str, Any]]] = []
        need = set(node.get("required", []))
        for name, prop in node.get("properties", {}).items():
            target = self.deref(prop)
            key = f"{path}.{name}" if path else name
            kind = self.type_of(prop)
            if target.get("type") == "object" and isinstance(
                    target.get("additionalProperties"), dict):
                sub = f"{key}.{PLACEHOLDERS.get(name, '<name>')}"
                kind = f"map: [`{sub}`](#{_anchor(sub)})"
                nested.append((sub, target["additionalProperties"]))
            elif "properties" in target:
                kind = f"section: [`{key}`](#{_anchor(key)})"
                nested.append((key, target))
            elif target.get("type") == "array" \
                    and "properties" in self.deref(target.get("items", {})):
                sub = f"{key}[]"
                kind = f"list of section: [`{sub}`](#{_anchor(sub)})"
                nested.append((sub, target["items"]))
            if name in need:
                default = "*required*"
            elif "default" in prop:
                default = _value(prop["default"])
            else:
                default = "see section"
            lines.append(f"| `{name}` | {kind} | {default} | "
                         f"{_text(prop.get('description', ''))} |")
        self.sections.append("\n".join(lines) + "\n")
        for sub, child in nested:
            self.section(sub, child)


def _text(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _value(v: Any) -> str:
    if isinstance(v, str):
        return f"`{v}`" if v else '`""`'
    return f"`{json.dumps(v)}`".replace("|", "\\|")


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than - and _ dropped."""
    return "".join(c for c in title.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def render() -> str:
    """``docs/config.md``: the reference of every key, from ``json_schema()``."""
    schema = json_schema()
    r = _Renderer(schema)
    r.section("", schema)
    return INTRO + "\n" + "\n".join(r.sections)
