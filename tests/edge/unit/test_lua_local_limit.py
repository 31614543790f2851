"""tokengate.local_limit: sliding-window RPM / TPM arithmetic with an explicit now.

The cases of lua/local_limit_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("local_limit"))
def test_local_limit(case: LuaCase) -> None:
    check(case)
