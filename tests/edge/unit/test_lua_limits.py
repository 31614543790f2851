"""tokengate.limits: the reset duration format, the TPM reservation and the headers.

The cases of lua/limits_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("limits"))
def test_limits(case: LuaCase) -> None:
    check(case)
