"""tokengate.apis.responses: the OpenAI Responses API's body checks, sanitizer walk, stored
response ids, stream and answer usage and input_tokens answer.

The cases of lua/responses_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("responses"))
def test_responses(case: LuaCase) -> None:
    check(case)
