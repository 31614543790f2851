"""The edge's request state is declared (lua/tokengate/state.lua): every ``ctx.<field>``
that a module of lua/tokengate/ reads or writes is a declared field, every assignment is
made by a module the field names as its writer, and every declared field is used.

The sources are read as text: comments are left out, and ``ngx.ctx`` may only be taken
whole (``local ctx = ngx.ctx``, or passed to a stage), never indexed, so that
``ctx.<field>`` is the one way a module reaches the state."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures_edge import run_lua

pytestmark = pytest.mark.unit

LUA = Path(__file__).resolve().parents[3] / "lua" / "tokengate"

_FIELD = re.compile(r"\bctx\.([A-Za-z_]\w*)")
# ctx.a = ..., ctx.a, ctx.b = ... (not ==)
_ASSIGN = re.compile(r"^\s*((?:ctx\.\w+\s*,\s*)*ctx\.\w+)\s*=(?!=)")


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    writers: frozenset[str]


@functools.cache
def declared() -> dict[str, Field]:
    """The FIELDS of tokengate.state, as the edge's LuaJIT loads them."""
    out = run_lua("""
        local FIELDS = require("tokengate.state").FIELDS
        local lines = {}
        for name, f in pairs(FIELDS) do
            lines[#lines + 1] = name .. "\\t" .. f[1] .. "\\t" .. f[2] .. "\\t" .. type(f[3])
        end
        return table.concat(lines, "\\n")""")
    fields = {}
    for line in out.splitlines():
        name, typ, writers, meaning = line.split("\t")
        assert meaning == "string", f"{name}: no meaning"
        fields[name] = Field(name, typ, frozenset(writers.split()))
    return fields


def _modules() -> dict[str, list[str]]:
    """module name (below tokengate.) -> its source lines without comments."""
    mods = {}
    for path in sorted(LUA.rglob("*.lua")):
        name = path.relative_to(LUA).with_suffix("").as_posix().replace("/", ".")
        mods[name] = [line.split("--", 1)[0] for line in path.read_text().splitlines()]
    return mods


def test_the_request_state_declares_sixty_odd_fields_each_with_a_type_and_a_writer() -> None:
    fields = declared()
    assert 50 <= len(fields) <= 70
    for f in fields.values():
        assert re.fullmatch(r"(string|number|boolean|table)(\|(string|number|boolean|table|nil))*",
                            f.type), f
        assert f.writers, f


def test_every_ctx_field_a_module_uses_is_declared() -> None:
    fields = declared()
    used = {name: sorted({m for line in lines for m in _FIELD.findall(line)})
            for name, lines in _modules().items()}
    undeclared = {name: [f for f in names if f not in fields]
                  for name, names in used.items()}
    assert {k: v for k, v in undeclared.items() if v} == {}
    every = {f for names in used.values() for f in names}
    assert sorted(set(fields) - every) == [], "declared but never used"


def test_every_ctx_field_is_written_only_by_its_declared_writers() -> None:
    fields = declared()
    wrong = []
    for name, lines in _modules().items():
        # "apis": the modules of lua/tokengate/apis/
        me = {name} | ({"apis"} if name.startswith("apis.") else set())
        for i, line in enumerate(lines, 1):
            m = _ASSIGN.match(line)
            if not m:
                continue
            for f in re.findall(r"ctx\.(\w+)", m.group(1)):
                if f in fields and not (me & fields[f].writers):
                    wrong.append(f"{name}.lua:{i}: ctx.{f} (writers: "
                                 f"{' '.join(sorted(fields[f].writers))})")
    assert wrong == []


def test_ngx_ctx_is_reached_only_through_ctx() -> None:
    indexed = [f"{name}.lua:{i}: {line.strip()}"
               for name, lines in _modules().items()
               for i, line in enumerate(lines, 1)
               if re.search(r"ngx\.ctx\s*[.\[:]", line) or re.search(r"\bctx\s*\[", line)]
    assert indexed == []
