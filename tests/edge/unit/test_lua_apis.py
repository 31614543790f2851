"""tokengate.api and tokengate.apis: every API module fits the declared interface, and
every route runs through the hooks the stages call (the API modules' contract).

The cases of lua/apis_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("apis"))
def test_apis(case: LuaCase) -> None:
    check(case)
