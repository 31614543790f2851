"""tokengate.bounds: structured-output constraints and fields vLLM does not read.

The cases of lua/bounds_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("bounds"))
def test_bounds(case: LuaCase) -> None:
    check(case)
