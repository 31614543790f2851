"""Every edge module reads only Lua's and ngx_lua's globals and writes none.

Lua has no declarations: a name that is no local is a global, so a misspelt or
removed local (``min`` once ``local min = math.min`` is gone) is read as a nil global
and fails only when that line runs. LuaJIT's bytecode says which names each module reads
(GGET) and writes (GSET) as globals: ``jit.bc`` lists them, in the edge's own nginx."""

from __future__ import annotations

import pytest
from tokengate_dev import devstack

from tests.fixtures_edge import run_lua

pytestmark = pytest.mark.unit

# Lua 5.1's base library and standard tables, LuaJIT's, and ngx_lua's ngx
ALLOWED = frozenset({
    "_G", "assert", "bit", "collectgarbage", "coroutine", "debug", "error", "getfenv",
    "getmetatable", "io", "ipairs", "jit", "load", "loadfile", "loadstring", "math",
    "module", "next", "ngx", "os", "package", "pairs", "pcall", "print", "rawequal",
    "rawget", "rawset", "require", "select", "setfenv", "setmetatable", "string",
    "table", "tonumber", "tostring", "type", "unpack", "xpcall",
})

_LIST = r'''
local bc = require "jit.bc"
local out = {}
for f in io.popen("find %s -name '*.lua' | sort"):lines() do
    local buf = {}
    bc.dump(assert(loadfile(f)), { write = function(_, s) buf[#buf + 1] = s end,
                                   flush = function() end }, true, true)
    for line in table.concat(buf):gmatch("[^\n]+") do
        local at, op, name = line:match('^%%d+ +%%[(%%d+)%%] +=?>? *(G[GS]ET) .-; "(.-)"')
        if op then
            out[#out + 1] = f .. ":" .. at .. " " .. op .. " " .. name
        end
    end
end
return table.concat(out, "\n")
'''


def test_edge_modules_read_only_known_globals_and_write_none() -> None:
    found = run_lua(_LIST % devstack.LUA_DIR).splitlines()
    assert found, "jit.bc listed no global access at all"
    bad = [f for f in found
           if f.split()[1] == "GSET" or f.split()[2] not in ALLOWED]
    assert bad == [], "globals read or written by mistake:\n" + "\n".join(bad)
