"""tokengate.budget: cost, nano-unit rounding, UTC periods, reservations and fallback.

The cases of lua/budget_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("budget"))
def test_budget(case: LuaCase) -> None:
    check(case)
