"""Traced chat-template rendering (tokengate.counter.template_trace) gives exactly what
transformers' own renderer (what vLLM calls) gives, conversation after conversation."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokengate.counter.chat_template import ChatTemplate
from tokengate.counter.template_trace import shape_key

from tests.conftest import REPO_CONFIG
from tests.counter_cases import CJK, EMOJI, WHITESPACE

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

MODEL_DIR = REPO_CONFIG.parent / "var" / "models" / "tiny-qwen3"
# what makes the Qwen3 template branch on a content, and what could confuse a trace
TRICKY = ["</think>", "<think>", "\n", "<tool_response>", "</tool_response>", "",
          "\ue000", "\ue0001\ue001", "\ue001", "<|im_end|>", "{{ x }}", "%s", CJK, EMOJI,
          WHITESPACE, "plain words"]


def reference(template: ChatTemplate, conversation: list[dict[str, Any]],
              kwargs: dict[str, Any]) -> str:
    # transformers' renderer itself (imported by the first call, not at collection)
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[conversation], tools=None,
                                        chat_template=template.source,
                                        **{**template.special_tokens_map, **kwargs})
    return str(rendered[0])


def conversation(rng: random.Random) -> list[dict[str, Any]]:
    roles = (["system"] if rng.random() < 0.6 else []) + [
        rng.choice(["user", "assistant", "user", "assistant", "tool", "system"])
        for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.7:
        roles.append("user")

    def content() -> str:
        return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 4)))
    return [{"role": r, "content": content()} for r in roles]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    t = ChatTemplate.from_model_dir(MODEL_DIR)
    assert t.why_not_traced == ""
    return t


def test_traced_render_equals_transformers_on_hostile_conversations(
        template: ChatTemplate) -> None:
    rng = random.Random(20261201)
    for _ in range(3000):
        conv = conversation(rng)
        kwargs: dict[str, Any] = {"add_generation_prompt": rng.random() < 0.8}
        if rng.random() < 0.3:
            kwargs["enable_thinking"] = rng.random() < 0.5
        assert template.render(conv, None, kwargs) == reference(template, conv, kwargs), conv
    # shapes and answers repeat across 3,000 conversations: many were assembled from
    # traces (shapes where a content reached a strip() or split() are rendered plainly)
    assert template.traces.hits > 300


def test_a_conversation_resent_with_its_history_reuses_the_shape_of_others(
        template: ChatTemplate) -> None:
    t = ChatTemplate.from_model_dir(MODEL_DIR)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    t.render(first, None, {"add_generation_prompt": True})
    assert (t.traces.recorded, t.traces.hits) == (1, 0)
    other = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Yo"}]
    assert t.render(other, None, {"add_generation_prompt": True}) == \
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nYo<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert (t.traces.recorded, t.traces.hits) == (1, 1)
    # another answer to a question the template asks ("</think>" in an assistant
    # content): recorded afresh, not assembled from the first trace
    turn = [*other, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    t.render(turn, None, {"add_generation_prompt": True})
    thinking = [*other, {"role": "assistant", "content": "<think>x</think>a"},
                {"role": "user", "content": "b"}]
    assert t.render(thinking, None, {"add_generation_prompt": True}) == \
        reference(t, thinking, {"add_generation_prompt": True})
    assert (t.traces.recorded, t.traces.hits) == (3, 1)
    # that content was split by the template (a recording it spoiled): the shape's
    # trace stays for the conversations it fits
    again = [*other, {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
    assert t.render(again, None, {"add_generation_prompt": True}) == \
        reference(t, again, {"add_generation_prompt": True})
    assert (t.traces.recorded, t.traces.hits) == (3, 2)


def test_a_shape_first_seen_with_a_spoiling_content_is_recorded_again_later() -> None:
    t = ChatTemplate.from_model_dir(MODEL_DIR)
    kwargs = {"add_generation_prompt": True}

    def conv(answer: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "q2"}]
    t.render(conv("<think>r</think>a"), None, kwargs)
    for i in range(63):  # rendered every time until the 64th
        assert t.render(conv(f"a{i}"), None, kwargs) == reference(t, conv(f"a{i}"), kwargs)
    assert (t.traces.recorded, t.traces.plain, t.traces.hits) == (1, 63, 0)
    t.render(conv("b"), None, kwargs)
    assert t.render(conv("c"), None, kwargs) == reference(t, conv("c"), kwargs)
    assert (t.traces.recorded, t.traces.plain, t.traces.hits) == (2, 63, 1)


@pytest.mark.parametrize("falsy", [0, 0.0, None, ""])
def test_an_argument_equal_to_false_but_not_false_has_its_own_trace(falsy: object) -> None:
    """Qwen3 tests ``enable_thinking is false``: 0 == False in Python, not in jinja."""
    t = ChatTemplate.from_model_dir(MODEL_DIR)
    conv = [{"role": "user", "content": "hello"}]
    for value in (False, falsy, False, falsy):
        kwargs = {"add_generation_prompt": True, "enable_thinking": value}
        assert t.render(conv, None, kwargs) == reference(t, conv, kwargs), value
    assert t.traces.hits == 2


def test_a_content_the_template_reads_spoils_the_shape_and_renders_plainly(
        tmp_path: Path) -> None:
    source = ("{% for m in messages %}{{ m.role }}:{{ m.content | trim }}|"
              "{{ m.content.split(',')[0] }}|{{ m.content | length }}\n{% endfor %}")
    t = ChatTemplate(source, {})
    assert t.why_not_traced == ""
    for text in (" a,b ", "cc,d", " a,b "):
        conv = [{"role": "user", "content": text}]
        assert t.render(conv, None, {}) == reference(t, conv, {})
    assert t.traces.hits == 0


@pytest.mark.parametrize(("source", "why"), [
    ("{{ messages[0].content.replace(messages[1].content, '') }}", "called with a variable"),
    ("{% if messages[0].content in messages[1].content %}x{% endif %}", "'in' with a variable"),
    ("{{ strftime_now('%Y') }}{{ messages[0].content }}", "changes from call to call"),
])
def test_templates_a_probe_could_not_follow_are_never_traced(source: str, why: str) -> None:
    t = ChatTemplate(source, {})
    assert why in t.why_not_traced
    conv = [{"role": "user", "content": "ab"}, {"role": "user", "content": "b"}]
    assert t.render(conv, None, {}) == reference(t, conv, {})
    assert t.render(conv, None, {}) == reference(t, conv, {})
    assert t.traces.recorded == 0


def test_only_plain_messages_and_scalar_arguments_have_a_shape() -> None:
    plain = [{"role": "user", "content": "x"}]
    assert shape_key(plain, {"add_generation_prompt": True}) == \
        (("user",), (("add_generation_prompt", bool, True),))
    assert shape_key([{"role": "user", "content": ["x"]}], {}) is None
    assert shape_key([{"role": "assistant", "content": "x", "tool_calls": []}], {}) is None
    assert shape_key(plain, {"documents": [{"text": "d"}]}) is None
