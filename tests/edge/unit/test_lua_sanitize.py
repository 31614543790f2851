"""tokengate.sanitize: invisible characters, special and structural tokens, repeated system prompts.

The cases of lua/sanitize_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("sanitize"))
def test_sanitize(case: LuaCase) -> None:
    check(case)
