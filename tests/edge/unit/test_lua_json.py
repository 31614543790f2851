"""tokengate.json: the strict JSON decoder and the encoder of forwarded bodies.

The cases of lua/json_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("json"))
def test_json(case: LuaCase) -> None:
    check(case)
