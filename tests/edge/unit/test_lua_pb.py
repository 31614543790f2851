"""tokengate.pb: counter frames and limits messages against Python's protobuf bytes.

The cases of lua/pb_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("pb"))
def test_pb(case: LuaCase) -> None:
    check(case)
