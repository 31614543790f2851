"""tokengate.apis.embeddings: POST /v1/embeddings' route, body checks, sanitizer, runner
check, budget and usage.

The cases of lua/embeddings_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("embeddings"))
def test_embeddings(case: LuaCase) -> None:
    check(case)
