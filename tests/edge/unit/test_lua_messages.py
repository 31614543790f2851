"""tokengate.apis.messages: the Anthropic Messages API's body checks, stream and answer
usage, error shape and count_tokens answer.

The cases of lua/messages_spec.lua, run in nginx's LuaJIT by lua_runner."""

import pytest

from tests.edge.unit.lua_runner import LuaCase, check, params

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", params("messages"))
def test_messages(case: LuaCase) -> None:
    check(case)
