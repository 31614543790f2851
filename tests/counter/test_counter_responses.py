"""OpenAI Responses bodies converted the way vLLM's Responses serving builds its prompt
(tokengate.counter.apis.openai_responses) and counted by the chat path, without any
process: the chat bodies they become, the counts beside the equivalent chat bodies,
max_output_tokens as the completion budget, and refusals that name the field."""

from __future__ import annotations

from typing import Any

import pytest
from tokengate.counter.apis import openai_responses as orr
from tokengate.counter.counting import BadRequest, ModelCounter

from tests.conftest import count_as_chat, count_refusal, suite_model
from tests.counter_cases import hostile_bodies
from tests.counter_responses_cases import (
    CASES,
    REFUSED,
    WEATHER,
    WEATHER_TURNS,
    call,
    itext,
    msg,
    out_message,
    output,
    reasoning,
)

pytestmark = pytest.mark.unit

WEATHER_CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": WEATHER["description"],
    "parameters": WEATHER["parameters"]}}


@pytest.fixture(scope="module")
def counter() -> ModelCounter:
    return ModelCounter.load(suite_model())


def chat(body: dict[str, Any]) -> dict[str, Any]:
    return orr.to_chat(body).body


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return list(chat(body)["messages"])


def test_string_input_and_instructions_become_system_and_user() -> None:
    assert chat({"instructions": "Be brief.", "input": "Hi"}) == {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}],
        "add_generation_prompt": True, "continue_final_message": False}
    # empty instructions add nothing; an empty string input is still a user turn
    assert messages({"instructions": "", "input": ""}) == [{"role": "user", "content": ""}]


def test_message_items_pass_on_and_assistants_keep_their_first_part() -> None:
    body = {"input": [msg("developer", [itext("Rule")]), msg("user", "a", type="message"),
                      out_message("kept", "dropped"), msg("assistant", [itext("said")])]}
    assert messages(body) == [
        {"role": "developer", "content": [{"type": "input_text", "text": "Rule"}]},
        {"role": "user", "content": "a", "type": "message"},
        {"role": "assistant", "content": "kept"},
        {"role": "assistant", "content": "said"}]


def test_calls_reasoning_and_text_merge_into_one_assistant_turn() -> None:
    body = {"input": [msg("user", "q"), reasoning("think"), out_message("Checking."),
                      call("c1", "get_weather", '{"city": "Oslo"}'),
                      call("c2", "lookup", "{}", namespace="crm"), output("c1", "-3"),
                      output("c2", [itext("Ada")]), reasoning(summary="only a summary")]}
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "c2", "type": "function", "function": {"name": "crm__lookup",
                                                           "arguments": "{}"}}]
    assert messages(body) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning": "think", "content": "Checking.",
         "tool_calls": calls},
        {"role": "tool", "content": "-3", "tool_call_id": "c1"},
        {"role": "tool", "content": [{"type": "input_text", "text": "Ada"}],
         "tool_call_id": "c2"},
        {"role": "assistant", "reasoning": "only a summary"}]
    # an assistant turn that already has reasoning starts a new one
    assert messages({"input": [reasoning("a"), reasoning("b")]}) == [
        {"role": "assistant", "reasoning": "a"}, {"role": "assistant", "reasoning": "b"}]


def test_tools_become_chat_function_tools() -> None:
    body = {"input": "x", "tools": [
        WEATHER, {"type": "function", "name": "ping", "strict": True, "defer_loading": True},
        {"type": "namespace", "name": "crm", "description": "d", "tools": [
            {"type": "function", "name": "lookup"}]},
        {"type": "custom", "name": "patch", "description": "Apply."},
        {"type": "web_search_preview"}]}
    assert chat(body)["tools"] == [
        WEATHER_CHAT_TOOL,
        {"type": "function", "function": {"name": "ping", "description": None,
                                          "parameters": None, "strict": True,
                                          "defer_loading": True}},
        {"type": "function", "function": {"name": "crm__lookup", "description": None,
                                          "parameters": None}},
        {"type": "function", "function": {"name": "patch", "description": "Apply.",
                                          "parameters": orr.CUSTOM_TOOL_PARAMETERS}}]
    # only built-in tools: an empty tool list, as vLLM renders it
    assert chat({"input": "x", "tools": [{"type": "web_search_preview"}]})["tools"] == []
    assert "tools" not in chat({"input": "x", "tools": []})


def test_effort_and_partial_last_message_set_the_template_arguments() -> None:
    assert chat({"input": "x", "reasoning": {"effort": "low"}})["reasoning_effort"] == "low"
    partial = chat({"input": [msg("user", "Go"), out_message("Once", status="incomplete")]})
    assert (partial["add_generation_prompt"], partial["continue_final_message"]) == \
        (False, True)
    done = chat({"input": [msg("user", "Go"), out_message("Once", status="completed")]})
    assert (done["add_generation_prompt"], done["continue_final_message"]) == (True, False)


def test_a_responses_body_counts_as_the_chat_body_it_becomes(counter: ModelCounter) -> None:
    body = {"instructions": "Be brief.", "tools": [WEATHER], "input": WEATHER_TURNS}
    same = {"tools": [WEATHER_CHAT_TOOL], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'}]}
    got, expected = count_as_chat(counter, "responses", body, same)
    # no max_output_tokens: the room left in the context
    assert (got.max_tokens_requested, got.max_tokens_effective) == \
        (0, 8192 - expected.prompt_tokens)
    r = counter.count("responses", {**body, "max_output_tokens": 100})
    assert (r.max_tokens_requested, r.max_tokens_effective) == (100, 100)
    r = counter.count("responses", {**body, "max_output_tokens": 8192.0})
    assert (r.max_tokens_requested, r.max_tokens_effective) == \
        (8192, 8192 - expected.prompt_tokens)


def test_previous_response_id_counts_what_the_body_holds(counter: ModelCounter) -> None:
    """vLLM's store is out of the counter's sight: the body's own input only."""
    body = {"input": "continue"}
    assert counter.count("responses", {**body, "previous_response_id": "resp_1"}) == \
        counter.count("responses", body)


@pytest.mark.parametrize("extra,message", [
    ({"max_output_tokens": 0}, "max_output_tokens: must be at least 1, got 0"),
    ({"max_output_tokens": "16"}, "max_output_tokens: expected an integer, got a string"),
    ({"max_output_tokens": 8193}, "max_output_tokens: 8193 is greater than max_model_len 8192"),
    ({"previous_response_id": 7}, "previous_response_id: expected a string, got an integer"),
    ({"previous_response_id": "resp_1", "previous_input_messages": [{"role": "user"}]},
     "previous_response_id: only one of previous_input_messages and previous_response_id"),
    ({"background": True, "store": False}, "background: background can only be used"),
])
def test_budget_and_history_fields_are_checked(counter: ModelCounter, extra: dict[str, Any],
                                               message: str) -> None:
    refused = count_refusal(counter, "responses", {"input": "Hi", **extra})
    assert str(refused).startswith(message), str(refused)


@pytest.mark.parametrize("name,body,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_refusals_name_the_field(counter: ModelCounter, name: str, body: dict[str, Any],
                                 message: str) -> None:
    refused = count_refusal(counter, "responses", body)
    assert str(refused).startswith(message), str(refused)


@pytest.mark.parametrize("body,message", [
    ({"input": [msg("user", "x"), out_message()]},
     "input[1].content: an assistant message needs a content part"),
    ({"input": [{"type": "message", "role": "assistant",
                 "content": [{"type": "refusal", "refusal": "no"}]}]},
     "input[0].content[0].type: a refusal part cannot lead"),
    ({"input": [msg("user", "x")], "tools": [{"type": "mystery"}]},
     "tools[0].type: unknown tool type 'mystery'"),
    ({"input": "x", "tools": [{"type": "custom", "name": "g",
                               "format": {"type": "grammar"}}]},
     "tools[0].format: custom tools with a grammar format are not supported"),
    ({"input": [], "chat_template_kwargs": {"enable_thinking": False}},
     "input: nothing to count"),
    ({"input": "x", "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools: not an allowed chat template argument"),
    # options of vLLM 0.32's ResponsesRequest refused there with pydantic's dump
    ({"input": "x", "text": {"format": {"type": "xml"}}},
     "text.format.type: expected one of 'text', 'json_schema', 'json_object', got 'xml'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name: expected a string, got null"),
    ({"input": "x", "text": "json"}, "text: expected an object, got a string"),
    ({"input": "x", "truncation": "bogus"},
     "truncation: expected one of 'auto', 'disabled', got 'bogus'"),
    ({"input": "x", "include": ["bogus"]}, "include[0]: expected one of "),
    ({"input": "x", "include": "reasoning.encrypted_content"},
     "include: expected an array, got a string"),
    ({"input": "x", "service_tier": "fast"}, "service_tier: expected one of 'auto', 'default'"),
    ({"input": "x", "metadata": "x"}, "metadata: expected an object, got a string"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k: expected a string, got an integer"),
])
def test_what_vllm_fails_on_is_a_named_refusal(counter: ModelCounter, body: dict[str, Any],
                                               message: str) -> None:
    refused = count_refusal(counter, "responses", body)
    assert str(refused).startswith(message), str(refused)


# this API's own wrong shapes, beside counter_cases.HOSTILE
WRONG_SHAPES: list[Any] = [{"type": "function_call"}, {"type": "reasoning", "summary": [{}]},
                           {"role": "assistant", "content": [None]},
                           {"type": "message", "role": "user"}]


def test_hostile_bodies_count_or_raise_bad_request_only(counter: ModelCounter) -> None:
    counted = refused = 0
    for _, body in hostile_bodies(CASES, WRONG_SHAPES):
        try:
            counter.count("responses", body)
            counted += 1
        except BadRequest:
            refused += 1
    assert counted > 300 and refused > 300, (counted, refused)
