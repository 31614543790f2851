"""tokengate.slo: latency targets (model, key, request headers; bad values 400), the
TTFT and TPOT prediction per replica and its online learning, and tokengate.upstream's
policy slo (the most headroom, prefix hits counted).

The cases of lua/slo_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("slo"))
def test_slo(case: LuaCase) -> None:
    check(case)
