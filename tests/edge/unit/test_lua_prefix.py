"""tokengate.prefix: the prefix plan, the recording grid and the approximate index.

The cases of lua/prefix_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("prefix"))
def test_prefix(case: LuaCase) -> None:
    check(case)
