"""Anthropic Messages bodies converted the way vLLM's Anthropic serving converts them
(tokengate.counter.apis.anthropic_messages) and counted by the chat path, without any
process: the chat bodies they become, the counts beside the equivalent chat bodies,
the template facts vLLM probes at start, and refusals that name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokengate.counter.apis import anthropic_messages as am
from tokengate.counter.counting import BadRequest, ModelCounter

from tests.conftest import count_as_chat, count_refusal, suite_model
from tests.counter_cases import hostile_bodies
from tests.counter_messages_cases import (
    CASES,
    DEFERRED,
    REFUSED,
    WEATHER,
    WEATHER_TURNS,
    assistant,
    text,
    tool_result,
    tool_use,
    user,
)

pytestmark = pytest.mark.unit

QWEN = am.TemplatePolicy(merge_inline_system=False, disabled_thinking_effort="none",
                         content_format="string")
MERGING = am.TemplatePolicy(merge_inline_system=True, disabled_thinking_effort="low",
                            content_format="string")


@pytest.fixture(scope="module")
def counter() -> ModelCounter:
    return ModelCounter.load(suite_model())


def chat(body: dict[str, Any], policy: am.TemplatePolicy = QWEN) -> dict[str, Any]:
    return am.to_chat(body, policy, count_tokens=True).body


def test_the_served_templates_facts_are_what_vllm_probes(counter: ModelCounter) -> None:
    """Qwen3's template renders a system message after a user turn, and renders
    reasoning_effort "none" (enable_thinking false) unlike any thinking effort."""
    assert counter._messages_policy() == QWEN


def test_system_first_templates_merge_inline_system_messages() -> None:
    assert not am.requires_system_first("{% for m in messages %}{{ m.content }}{% endfor %}")
    guard = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
             "{{ raise_exception('System message must be first') }}{% endif %}"
             "{{ m.content }}{% endfor %}")
    assert am.requires_system_first(guard)
    # vLLM renders without transformers' globals: a template calling one merges
    assert am.requires_system_first("{{ strftime_now('%Y') }}{{ messages[0].content }}")
    assert am.requires_system_first("")
    assert am.requires_system_first("{% for m in messages %}{{ m.content + 1 }}{% endfor %}")


def test_disabled_thinking_is_none_unless_the_template_ignores_or_rejects_it() -> None:
    assert am.disabled_thinking_effort(lambda e: f"prompt {e == 'none'}") == "none"
    assert am.disabled_thinking_effort(lambda e: "same") == "low"
    assert am.disabled_thinking_effort(lambda e: None if e == "none" else e) == "low"
    assert am.disabled_thinking_effort(lambda e: "x" if e in ("none", "max") else e) == "low"


def test_system_string_and_blocks_become_one_leading_message() -> None:
    body = {"system": [text("You are "), text(""), text("x-anthropic-billing-header: cch=1"),
                       {"type": "image", "source": {"type": "url", "url": "u"}}, text("terse.")],
            "messages": [user("Hi")]}
    assert chat(body) == {"messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "Hi"}]}
    # the string form keeps the header line (the chat path drops it, as vLLM's does)
    body = {"system": "x-anthropic-billing-header: a\nReal", "messages": [user("Hi")]}
    assert chat(body)["messages"][0] == {"role": "system",
                                         "content": "x-anthropic-billing-header: a\nReal"}


def test_inline_system_messages_stay_or_merge_by_template() -> None:
    body = {"system": "Lead.", "messages": [
        user("a"), {"role": "system", "content": [text("Re"), text("minder")]}, user("b"),
        {"role": "system", "content": "x-anthropic-billing-header: only"}]}
    assert chat(body)["messages"] == [
        {"role": "system", "content": "Lead."}, {"role": "user", "content": "a"},
        {"role": "system", "content": "Reminder"}, {"role": "user", "content": "b"}]
    assert chat(body, MERGING)["messages"] == [
        {"role": "system", "content": "Lead.Reminder"}, {"role": "user", "content": "a"},
        {"role": "user", "content": "b"}]


def test_tool_results_come_before_the_user_message_that_carries_them() -> None:
    msgs = chat({"tools": [WEATHER], "messages": WEATHER_TURNS})["messages"]
    assert msgs[1:] == [
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_02", "type": "function", "function": {
                "name": "get_weather",
                "arguments": '{"city": "\\u6771\\u4eac", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18°C, cloudy"},
        {"role": "tool", "tool_call_id": "toolu_02", "content": "22°C\nsunny ☀️"},
        {"role": "user", "content": "Thanks, now summarize."}]


def test_blocks_thinking_references_and_assistant_tool_results() -> None:
    msgs = chat({"messages": [
        user([text("a"), text("b")]),
        assistant([{"type": "thinking", "thinking": "hm"}, {"type": "redacted_thinking"},
                   {"type": "thinking", "thinking": "!"}, {"type": "tool_reference"},
                   tool_result("t", [text("x"), {"n": 1.5}])]),
        user([tool_result("t", [{"type": "tool_reference", "tool_name": "run_sql"},
                                {"type": "tool_reference", "name": "b"}, text("ok")])]),
        assistant([]), user([text("")])]})["messages"]
    assert msgs == [
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "reasoning": "hm!",
         "content": "Tool result: [{'type': 'text', 'text': 'x'}, {'n': 1.5}]"},
        {"role": "tool", "tool_call_id": "t", "content": "ok"},
        {"role": "tool", "tool_call_id": "t", "content": "run_sql\nb"},
        {"role": "assistant"}]


def test_tools_schema_type_is_appended_and_tool_changes_apply_in_order() -> None:
    body = {"tools": [{"name": "a", "input_schema": {"properties": {}}}, WEATHER, DEFERRED],
            "messages": [{"role": "system", "content": [
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "run_sql"}},
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}},
                {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
                    "name": "a", "input_schema": {"type": "object"}, "strict": True}}},
                {"type": "tool_removal", "tool": {"type": "tool_reference",
                                                  "name": "get_weather"}}]},
                user("x")]}
    tools = chat(body)["tools"]
    assert [t["function"]["name"] for t in tools] == ["a", "run_sql"]
    assert tools[0] == {"type": "function", "function": {
        "name": "a", "description": None, "parameters": {"type": "object"}, "strict": True}}
    assert "defer_loading" not in tools[1]["function"]  # added by reference: loaded now
    plain = chat({"tools": [{"name": "a", "input_schema": {"properties": {}}}],
                  "messages": [user("x")]})["tools"]
    assert json.dumps(plain[0]["function"]["parameters"]) == '{"properties": {}, "type": "object"}'


def test_thinking_and_effort_set_reasoning_effort() -> None:
    hi = [user("Hi")]
    assert "reasoning_effort" not in chat({"messages": hi, "thinking": {
        "type": "enabled", "budget_tokens": 1024}})
    assert chat({"messages": hi, "output_config": {"effort": "max"}})["reasoning_effort"] == "max"
    assert chat({"messages": hi, "output_config": {"effort": "max"},
                 "thinking": {"type": "disabled"}})["reasoning_effort"] == "none"
    assert chat({"messages": hi, "thinking": {"type": "disabled"}},
                MERGING)["reasoning_effort"] == "low"


def test_a_messages_body_counts_as_the_chat_body_it_becomes(counter: ModelCounter) -> None:
    messages = {"system": "Be brief.", "tools": [WEATHER], "thinking": {"type": "disabled"},
                "messages": [user("Weather in Oslo?"),
                             assistant([tool_use("t", "get_weather", {"city": "Oslo"})]),
                             user([tool_result("t", "-3°C")])]}
    same = {"reasoning_effort": "none", "tools": [{"type": "function", "function": {
        "name": WEATHER["name"], "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}}], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "t", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t", "content": "-3°C"}]}
    got, expected = count_as_chat(counter, "count_tokens", messages, same)
    assert (got.max_tokens_requested, got.max_tokens_effective) == (0, 0)
    r = counter.count("messages", {**messages, "max_tokens": 100})
    assert (r.prompt_tokens, r.max_tokens_requested, r.max_tokens_effective) == (
        expected.prompt_tokens, 100, 100)
    r = counter.count("messages", {**messages, "max_tokens": 8192})
    assert r.max_tokens_effective == 8192 - expected.prompt_tokens


@pytest.mark.parametrize("extra,message", [
    ({}, "max_tokens: required integer"),
    ({"max_tokens": None}, "max_tokens: required integer"),
    ({"max_tokens": 0}, "max_tokens: must be positive, got 0"),
    ({"max_tokens": "16"}, "max_tokens: expected an integer, got a string"),
    ({"max_tokens": 8193}, "max_tokens: 8193 is greater than max_model_len 8192"),
    ({"max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking.budget_tokens: must be less than max_tokens (1024 >= 1024)"),
    ({"max_tokens": 16, "metadata": "abc"}, "metadata: expected an object, got a string"),
])
def test_messages_checks_max_tokens_count_tokens_ignores_it(
        counter: ModelCounter, extra: dict[str, Any], message: str) -> None:
    body = {"messages": [user("Hi")], **extra}
    assert str(count_refusal(counter, "messages", body)) == message
    assert counter.count("count_tokens", body).prompt_tokens == 9


def test_max_tokens_16_0_is_an_integer_and_remote_decode_skips_the_budget_check(
        counter: ModelCounter) -> None:
    body = {"messages": [user("Hi")], "max_tokens": 16.0}
    assert counter.count("messages", body).max_tokens_requested == 16
    body = {"messages": [user("Hi")], "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True}, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert counter.count("messages", body).prompt_tokens == 9


@pytest.mark.parametrize("name,body,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_refusals_name_the_field(counter: ModelCounter, name: str, body: dict[str, Any],
                                 message: str) -> None:
    assert str(count_refusal(counter, "count_tokens", body)).startswith(message)


@pytest.mark.parametrize("body,message", [
    ({}, "messages: required array of messages, got null"),
    ({"messages": []}, "messages: nothing to count"),
    ({"messages": [user([])]}, "messages: nothing to count"),
    ({"messages": ["hi"]}, "messages[0]: expected an object, got a string"),
    ({"messages": [{"content": "x"}]}, "messages[0].role: required string"),
    ({"messages": [user({"type": "text"})]},
     "messages[0].content: expected a string or an array of content blocks, got an object"),
    ({"messages": [user(["x"])]}, "messages[0].content[0]: expected a content block object"),
    ({"messages": [user([{"text": "x"}])]}, "messages[0].content[0].type: required string"),
    ({"messages": [user([tool_result("t", [5])])]},
     "messages[0].content[0].content[0]: expected an object, got an integer"),
    ({"messages": [user([tool_result("t", [{"type": "text", "text": None}])])]},
     "messages[0].content[0].content[0].text: expected a string, got null"),
    ({"messages": [user([tool_result("t", [{"type": "image", "source": None}])])]},
     "messages[0].content[0].content[0].source: expected an object, got null"),
    ({"messages": [user([tool_result("t", [{"type": "tool_reference", "name": 7}])])]},
     "messages[0].content[0].content[0].tool_name: expected a string, got an integer"),
    ({"messages": [user([tool_use("t", "f", [1])])]},
     "messages[0].content[0].input: expected an object, got an array"),
    ({"messages": [user([{"type": "text", "text": "x", "is_error": "yes"}])]},
     "messages[0].content[0].is_error: expected a boolean, got a string"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_addition"}]}]},
     "messages[0].content[0].tool: required for tool_addition blocks"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_removal", "tool": {
        "type": "tool_definition", "definition": {"name": "a", "input_schema": {}}}}]}]},
     "messages[0].content[0].tool.type: tool_removal only accepts a tool_reference"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_addition", "tool": {
        "type": "tool"}}]}]},
     "messages[0].content[0].tool.type: expected 'tool_reference' or 'tool_definition'"),
    ({"system": 5, "messages": [user("x")]},
     "system: expected a string or an array of content blocks, got an integer"),
    ({"system": {}, "messages": [user("x")]},
     "system: expected a string or an array of content blocks, got an object"),
    ({"system": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}],
      "messages": [user("x")]},
     "system[0].type: tool_addition blocks are only allowed in messages with role 'system'"),
    ({"tools": {}, "messages": [user("x")]}, "tools: expected an array of tools, got an object"),
    ({"tools": [{"input_schema": {}}], "messages": [user("x")]}, "tools[0].name: required string"),
    ({"tools": [{"name": "a", "input_schema": {}, "strict": "no"}], "messages": [user("x")]},
     "tools[0].strict: expected a boolean, got a string"),
    ({"tool_choice": "auto", "messages": [user("x")]},
     "tool_choice: expected an object, got a string"),
    ({"tool_choice": {"type": ["auto"]}, "messages": [user("x")]},
     "tool_choice.type: expected one of any, auto, none, tool"),
    ({"thinking": {"type": "on"}, "messages": [user("x")]},
     "thinking.type: expected 'enabled', 'disabled' or 'adaptive'"),
    ({"thinking": {"type": "enabled"}, "messages": [user("x")]},
     "thinking.budget_tokens: required integer"),
    ({"thinking": {"type": "adaptive", "display": ["x"]}, "messages": [user("x")]},
     "thinking.display: expected one of omitted, summarized, updates"),
    ({"output_config": {"effort": "extreme"}, "messages": [user("x")]},
     "output_config.effort: expected one of low, medium, high, xhigh, max"),
    ({"output_config": {"format": {"type": "text"}}, "messages": [user("x")]},
     "output_config.format.type: expected 'json_schema'"),
    ({"chat_template_kwargs": {"tools": []}, "messages": [user("x")]},
     "chat_template_kwargs.tools: not an allowed chat template argument"),
])
def test_malformed_fields_are_named(counter: ModelCounter, body: dict[str, Any],
                                    message: str) -> None:
    refused = count_refusal(counter, "count_tokens", body)
    assert str(refused).startswith(message), str(refused)


# this API's own wrong shapes, beside counter_cases.HOSTILE
WRONG_SHAPES: list[Any] = [{"type": "tool_result", "content": [{"type": "image"}]},
                           {"type": "tool_addition",
                            "tool": {"type": "tool_reference", "name": 1}}]


def test_hostile_bodies_count_or_raise_bad_request_only(counter: ModelCounter) -> None:
    counted = refused = 0
    for rng, body in hostile_bodies(CASES, WRONG_SHAPES):
        for endpoint in ("count_tokens", "messages"):
            try:
                counter.count(endpoint, {**body, "max_tokens": 1} if endpoint == "messages"
                              and rng.random() < 0.8 else body)
                counted += 1
            except BadRequest:
                refused += 1
    # seeded: both ways are walked many times (492 and 4,242)
    assert counted > 400 and refused > 3000, (counted, refused)
