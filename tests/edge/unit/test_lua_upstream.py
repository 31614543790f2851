"""tokengate.upstream: the replica each routing policy picks (least_outstanding,
round_robin, prefix) after the rank and awake-before-asleep precedence; the rank
(tokengate.admission) and whether it is steady for a priority level.

The cases of lua/upstream_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("upstream"))
def test_upstream(case: LuaCase) -> None:
    check(case)
