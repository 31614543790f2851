"""Anthropic Messages bodies (``POST /v1/messages``, ``POST /v1/messages/count_tokens``)
as the chat request vLLM 0.32 makes of them.

vLLM serves the Messages API by converting the body into a ``ChatCompletionRequest``
and rendering that with the chat path (``vllm/entrypoints/anthropic/serving.py``,
``AnthropicServingMessages.to_chat_completion_request``; ``count_tokens`` renders the
same conversion and reports its prompt length as ``input_tokens``). ``to_chat`` does
that conversion in our own terms and hands back the OpenAI chat body that
``ModelCounter``'s chat path counts:

- ``system`` (a string, or blocks whose non-empty text blocks are joined with no
  separator, a block starting with ``x-anthropic-billing-header`` dropped) becomes one
  leading system message (``_convert_system_message``);
- a ``system``-role message inside ``messages`` stays where it is, or is merged into
  the leading system message when the template demands system-first ordering
  (``_detect_merge_inline_system``: ``requires_system_first``);
- content blocks (``_convert_message_content``, ``_convert_block``): non-empty ``text``
  blocks become text parts (a single one: a string content), ``thinking`` the
  message's ``reasoning``, ``tool_use`` an OpenAI tool call whose arguments are
  ``json.dumps(input or {})``, ``redacted_thinking`` and ``tool_reference`` nothing;
  a user message that keeps no content is dropped;
- a user ``tool_result`` becomes a ``tool`` message placed before the user message
  that carries it (its text items joined with "\\n"; named ``tool_reference`` items a
  second ``tool`` message); an assistant ``tool_result`` becomes the text part
  ``"Tool result: " + str(content)`` (Python's ``str`` of the parsed JSON, as vLLM);
- ``tools`` become function tools (``_convert_tools``), after the ``tool_addition`` /
  ``tool_removal`` blocks of system messages are applied (``_resolve_tools``); an
  ``input_schema`` without ``type`` gets ``"type": "object"`` appended
  (``AnthropicTool.validate_input_schema``);
- ``output_config.effort`` sets ``reasoning_effort``; ``thinking: {"type":
  "disabled"}`` sets it to the effort vLLM probes for "disabled"
  (``_handle_thinking``, ``_probe_disabled_thinking_effort``: ``"none"`` unless the
  template rejects it or renders it like a thinking effort, then ``"low"``);
  ``thinking: enabled`` only sets a generation budget; ``tool_choice`` never changes
  the prompt (a forced ``tool`` that ``tools`` does not declare is refused, as vLLM's
  tool parser refuses it);
- ``chat_template_kwargs`` (a vLLM extension) passes on to the chat path.

Validation follows vLLM's pydantic models (``vllm/entrypoints/anthropic/protocol.py``):
what they refuse and this module reads is refused with ``BadRequest`` naming the field
("messages[2].content[0].type: ..."). ``max_tokens`` is required (an integer >= 1) on
``/v1/messages``; ``count_tokens`` bodies have none (vLLM ignores one that is there).
Image blocks are refused: the counter's models read text only (vLLM's renderer then
fails the request too).

Assumes the server's ``--anthropic-disabled-thinking-effort`` is its default
(``auto``) and that a model directory's single chat template serves tool and non-tool
requests alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from tokengate.counter.errors import BadRequest, expect, expect_name, type_name

BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference",
                         "thinking", "redacted_thinking", "tool_addition", "tool_removal"})
TOOL_CHANGES = ("tool_addition", "tool_removal")
ROLES = ("user", "assistant", "system")
# AnthropicEffort, tried by vLLM's probe in this order
EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_DISPLAYS = frozenset({"summarized", "omitted", "updates"})
TOOL_CHOICE_TYPES = frozenset({"auto", "any", "tool", "none"})
_BILLING_HEADER = "x-anthropic-billing-header"
# AnthropicThinkingConfigEnabled.budget_tokens: Field(ge=1024)
MIN_THINKING_BUDGET = 1024
# Optional fields of AnthropicContentBlock and the JSON types each accepts (besides null).
_BLOCK_FIELDS: dict[str, tuple[type, ...]] = {
    "text": (str,), "source": (dict,), "id": (str,), "tool_use_id": (str,), "name": (str,),
    "input": (dict,), "content": (str, list), "is_error": (bool,), "tool_name": (str,),
    "thinking": (str,), "signature": (str,), "data": (str,), "tool": (dict,),
}


@dataclass(frozen=True)
class TemplatePolicy:
    """What vLLM's ``AnthropicServingMessages`` derives from the served chat template
    once, at start: whether inline system messages are merged into the leading one,
    the ``reasoning_effort`` of ``thinking: disabled``, and the template's content
    format ("string" or "openai")."""

    merge_inline_system: bool
    disabled_thinking_effort: str
    content_format: str


@dataclass(frozen=True)
class ChatRequest:
    """A Messages body converted: the OpenAI chat body the chat path counts (messages,
    tools, reasoning_effort, chat_template_kwargs: nothing else of the original body)
    and the body's ``max_tokens`` (None for count_tokens)."""

    body: dict[str, Any]
    max_tokens: int | None


@dataclass
class _Tool:
    """``AnthropicTool`` after validation; ``input_schema`` is the body's own copy."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    strict: bool | None
    defer_loading: bool | None


@dataclass
class _Block:
    """``AnthropicContentBlock`` after validation: its type and the fields it sets."""

    where: str
    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tool: _ToolChange | None = None

    def get(self, name: str) -> Any:
        return self.fields.get(name)


@dataclass(frozen=True)
class _ToolChange:
    """The ``tool`` of a tool_addition / tool_removal block: a reference by name or a
    definition by value."""

    name: str
    definition: _Tool | None


@dataclass
class _Message:
    where: str
    role: str
    content: str | list[_Block]


def _opt_bool(obj: dict[str, Any], key: str, where: str) -> bool | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{where}.{key}", f"expected a boolean, got {type_name(v)}")
    return v


def _opt_str(obj: dict[str, Any], key: str, where: str) -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"{where}.{key}", f"expected a string, got {type_name(v)}")
    return v


def _int(v: Any, where: str) -> int:
    """An integer (integral floats such as 16.0 count, as in pydantic's lax mode)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(where, f"expected an integer, got {type_name(v)}")
    return v


# -- validation (vllm/entrypoints/anthropic/protocol.py) ----------------------------------

def _tool(where: str, t: Any) -> _Tool:
    """``AnthropicTool``: name and input_schema required."""
    expect(where, t, (dict,), "an object")
    name = t.get("name")
    if not isinstance(name, str):
        raise BadRequest(f"{where}.name", "required string")
    schema = t.get("input_schema")
    if not isinstance(schema, dict):
        kind = t.get("type")
        if isinstance(kind, str) and kind != "custom":  # web_search_20250305, bash_...
            raise BadRequest(f"{where}.type", f"server tool {kind!r} is not supported: only "
                                              "client tools (a name and an input_schema)")
        raise BadRequest(f"{where}.input_schema", f"required object, got {type_name(schema)}")
    schema = dict(schema)
    if "type" not in schema:  # validate_input_schema appends it (key order is rendered)
        schema["type"] = "object"
    return _Tool(name, _opt_str(t, "description", where), schema,
                 _opt_bool(t, "strict", where), _opt_bool(t, "defer_loading", where))


def _tool_change(where: str, v: dict[str, Any]) -> _ToolChange:
    kind = v.get("type")
    if kind == "tool_reference":
        name = v.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"{where}.name", "required string")
        return _ToolChange(name, None)
    if kind == "tool_definition":
        definition = _tool(f"{where}.definition", v.get("definition"))
        return _ToolChange(definition.name, definition)
    raise BadRequest(f"{where}.type", "expected 'tool_reference' or 'tool_definition'")


def _block(where: str, b: Any, tool_changes: bool) -> _Block:
    """``AnthropicContentBlock``; tool_addition / tool_removal only where
    ``tool_changes`` (messages of role system)."""
    expect(where, b, (dict,), "a content block object")
    kind = expect_name(f"{where}.type", b.get("type"), BLOCK_TYPES, "content block type")
    fields: dict[str, Any] = {}
    for key, kinds in _BLOCK_FIELDS.items():
        v = b.get(key)
        if v is None:
            continue
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            what = " or ".join({str: "a string", dict: "an object", list: "an array",
                                bool: "a boolean"}[k] for k in kinds)
            raise BadRequest(f"{where}.{key}", f"expected {what}, got {type_name(v)}")
        fields[key] = v
    content = fields.get("content")
    if isinstance(content, list):
        for k, item in enumerate(content):
            expect(f"{where}.content[{k}]", item, (dict,), "an object")
    block = _Block(where, kind, fields)
    if "tool" in fields:
        block.tool = _tool_change(f"{where}.tool", fields["tool"])
    if kind in TOOL_CHANGES:
        if not tool_changes:
            raise BadRequest(f"{where}.type", f"{kind} blocks are only allowed in messages "
                                              "with role 'system'")
        if block.tool is None:
            raise BadRequest(f"{where}.tool", f"required for {kind} blocks")
        if kind == "tool_removal" and block.tool.definition is not None:
            raise BadRequest(f"{where}.tool.type", "tool_removal only accepts a tool_reference")
    return block


def _content(where: str, v: Any, tool_changes: bool) -> str | list[_Block]:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest(where, f"expected a string or an array of content blocks, got "
                                f"{type_name(v)}")
    return [_block(f"{where}[{j}]", b, tool_changes) for j, b in enumerate(v)]


def _message(i: int, m: Any) -> _Message:
    where = f"messages[{i}]"
    expect(where, m, (dict,), "an object")
    role = expect_name(f"{where}.role", m.get("role"), ROLES, "role")
    if "content" not in m or m["content"] is None:
        raise BadRequest(f"{where}.content", "required string or array of content blocks")
    return _Message(where, role, _content(f"{where}.content", m["content"], role == "system"))


def _thinking(body: dict[str, Any], max_tokens: int | None) -> str | None:
    """The ``thinking`` config's type (None when absent); checks ``budget_tokens``."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    expect("thinking", thinking, (dict,), "an object")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("thinking.type", "expected 'enabled', 'disabled' or 'adaptive'")
    if kind != "disabled":
        display = thinking.get("display")
        if display is not None and not (isinstance(display, str)
                                        and display in THINKING_DISPLAYS):
            raise BadRequest("thinking.display", "expected one of "
                             + ", ".join(sorted(THINKING_DISPLAYS)))
    if kind == "enabled":
        if thinking.get("budget_tokens") is None:
            raise BadRequest("thinking.budget_tokens", "required integer")
        budget = _int(thinking["budget_tokens"], "thinking.budget_tokens")
        if budget < MIN_THINKING_BUDGET:
            raise BadRequest("thinking.budget_tokens",
                             f"must be at least {MIN_THINKING_BUDGET}, got {budget}")
        # validate_thinking_budget, skipped for a disaggregated prefill leg
        kv = body.get("kv_transfer_params")
        remote = isinstance(kv, dict) and kv.get("do_remote_decode")
        if max_tokens is not None and budget >= max_tokens and not remote:
            raise BadRequest("thinking.budget_tokens", f"must be less than max_tokens "
                                                       f"({budget} >= {max_tokens})")
    return str(kind)


def _output_effort(body: dict[str, Any]) -> str | None:
    config = body.get("output_config")
    if config is None:
        return None
    expect("output_config", config, (dict,), "an object")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise BadRequest("output_config.effort", "expected one of " + ", ".join(EFFORTS))
    fmt = config.get("format")
    if fmt is not None:
        expect("output_config.format", fmt, (dict,), "an object")
        if fmt.get("type", "json_schema") != "json_schema":
            raise BadRequest("output_config.format.type", "expected 'json_schema'")
        if fmt.get("schema") is not None:
            expect("output_config.format.schema", fmt["schema"], (dict,), "an object")
    return effort


def _check_tool_choice(body: dict[str, Any]) -> None:
    """``AnthropicToolChoice`` (it changes no prompt token: only checked)."""
    choice = body.get("tool_choice")
    if choice is None:
        return
    expect("tool_choice", choice, (dict,), "an object")
    kind = choice.get("type")
    if not (isinstance(kind, str) and kind in TOOL_CHOICE_TYPES):
        raise BadRequest("tool_choice.type", "expected one of "
                         + ", ".join(sorted(TOOL_CHOICE_TYPES)))
    name = _opt_str(choice, "name", "tool_choice")
    if kind == "tool" and not name:
        raise BadRequest("tool_choice.name", "required when type is 'tool'")
    _opt_bool(choice, "disable_parallel_tool_use", "tool_choice")


def _max_tokens(body: dict[str, Any]) -> int:
    if body.get("max_tokens") is None:
        raise BadRequest("max_tokens", "required integer")
    n = _int(body["max_tokens"], "max_tokens")
    if n <= 0:
        raise BadRequest("max_tokens", f"must be positive, got {n}")
    return n


# -- conversion (vllm/entrypoints/anthropic/serving.py) -----------------------------------

def _system_text(m: _Message) -> str | None:
    """``_extract_system_text``: a system message's text, billing headers dropped."""
    if isinstance(m.content, str):
        return None if m.content.startswith(_BILLING_HEADER) else m.content
    parts = [b.get("text") for b in m.content
             if b.type == "text" and b.get("text") and not b.get("text").startswith(
                 _BILLING_HEADER)]
    return "".join(parts) if parts else None


def _system_parts(body: dict[str, Any]) -> list[str]:
    """``_convert_system_message``'s parts from the top-level ``system``."""
    system = body.get("system")
    if not system:  # None, "" and [] add nothing
        if system is not None and not isinstance(system, (str, list)):
            raise BadRequest("system", f"expected a string or an array of content blocks, "
                                       f"got {type_name(system)}")
        return []
    content = _content("system", system, tool_changes=False)
    if isinstance(content, str):
        return [content]
    return [b.get("text") for b in content if b.type == "text" and b.get("text")
            and not b.get("text").startswith(_BILLING_HEADER)]


def _refuse_image(where: str) -> BadRequest:
    return BadRequest(where, "image content is not supported: this model reads text only")


def _tool_result_image(where: str, source: Any) -> bool:
    """Whether an image item of a tool result becomes an image for vLLM
    (``_convert_image_source_to_url`` gives a URL that is not empty: a base64 source
    always does)."""
    if not isinstance(source, dict):
        raise BadRequest(f"{where}.source", f"expected an object, got {type_name(source)}")
    return source.get("type") != "url" or bool(source.get("url", ""))


def _user_tool_result(b: _Block, policy: TemplatePolicy,
                      out: list[dict[str, Any]]) -> None:
    """``_convert_user_tool_result``: a tool message (and one of its tool references)."""
    content = b.get("content")
    text = ""
    refs: list[str] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for k, item in enumerate(content):
            where = f"{b.where}.content[{k}]"
            kind = item.get("type")
            if kind == "text":
                t = item.get("text", "")
                if not isinstance(t, str):
                    raise BadRequest(f"{where}.text", f"expected a string, got {type_name(t)}")
                texts.append(t)
            elif kind == "image":
                if _tool_result_image(where, item.get("source", {})):
                    raise _refuse_image(where)
            elif kind == "tool_reference":
                ref = item.get("tool_name") or item.get("name")
                if ref:
                    if not isinstance(ref, str):
                        raise BadRequest(f"{where}.tool_name", f"expected a string, got "
                                                               f"{type_name(ref)}")
                    refs.append(ref)
        text = "\n".join(texts)
    call_id = b.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if refs:
        # vLLM's chat parsing reads each reference as its name; a "string" template
        # gets them joined with "\n", an "openai" one the parts themselves
        if policy.content_format == "openai":
            raise BadRequest(f"{b.where}.content", "tool_reference items are not supported "
                                                   "with this model's chat template")
        out.append({"role": "tool", "tool_call_id": call_id, "content": "\n".join(refs)})


def _convert_message(m: _Message, policy: TemplatePolicy,
                     out: list[dict[str, Any]]) -> None:
    """``_convert_messages`` for one non-system message (``_convert_message_content``,
    ``_convert_block``): tool messages of its tool results first, then the message."""
    msg: dict[str, Any] = {"role": m.role}
    if isinstance(m.content, str):
        msg["content"] = m.content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in m.content:
            if b.type == "text" and b.get("text"):
                parts.append({"type": "text", "text": b.get("text")})
            elif b.type == "image" and b.get("source"):
                raise _refuse_image(b.where)
            elif b.type == "thinking" and b.get("thinking") is not None:
                reasoning.append(b.get("thinking"))
            elif b.type == "tool_use":
                calls.append({"id": b.get("id") or f"call_{int(time.time())}",
                              "type": "function",
                              "function": {"name": b.get("name") or "",
                                           "arguments": json.dumps(b.get("input") or {})}})
            elif b.type == "tool_result":
                if m.role == "user":
                    _user_tool_result(b, policy, out)
                else:
                    result = b.get("content")
                    parts.append({"type": "text",
                                  "text": f"Tool result: {str(result) if result else ''}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if len(parts) == 1:
            msg["content"] = parts[0]["text"]
        elif parts:
            msg["content"] = parts
    if not (m.role == "user" and "content" not in msg):
        out.append(msg)


def _resolve_tools(body: dict[str, Any], messages: list[_Message]) -> list[_Tool] | None:
    """``_resolve_tools``: ``tools`` as the system messages' tool_addition and
    tool_removal blocks leave them at the end of the conversation."""
    raw = body.get("tools")
    tools: list[_Tool] | None = None
    if raw is not None:
        if not isinstance(raw, list):
            raise BadRequest("tools", f"expected an array of tools, got {type_name(raw)}")
        tools = [_tool(f"tools[{i}]", t) for i, t in enumerate(raw)]
    changes = [b for m in messages if not isinstance(m.content, str) for b in m.content
               if b.type in TOOL_CHANGES]
    if not changes:
        return tools
    by_name = {t.name: t for t in tools or []}
    removed: set[str] = set()
    for b in changes:
        assert b.tool is not None
        name = b.tool.name
        if b.tool.definition is not None:
            by_name[name] = b.tool.definition
        else:
            if name not in by_name:
                raise BadRequest(f"{b.where}.tool.name", f"{b.type} references tool {name!r}, "
                                                         "which is not declared in tools")
            if b.type == "tool_addition":
                old = by_name[name]
                by_name[name] = _Tool(old.name, old.description, old.input_schema, old.strict,
                                      None)
        if b.type == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in by_name.items() if name not in removed]


def _chat_tool(t: _Tool) -> dict[str, Any]:
    """``_convert_tools``' function tool, in the chat body's shape."""
    fn: dict[str, Any] = {"name": t.name, "description": t.description,
                          "parameters": t.input_schema}
    if t.strict is not None:
        fn["strict"] = t.strict
    if t.defer_loading is not None:
        fn["defer_loading"] = t.defer_loading
    return {"type": "function", "function": fn}


def to_chat(body: dict[str, Any], policy: TemplatePolicy, *, count_tokens: bool) -> ChatRequest:
    """The chat request vLLM makes of Messages ``body`` (parsed JSON) for
    ``/v1/messages`` or, with ``count_tokens``, ``/v1/messages/count_tokens``
    (``AnthropicServingMessages.to_chat_completion_request``).

    Raises ``BadRequest`` naming the field of the Messages body.
    """
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise BadRequest("messages", f"required array of messages, got {type_name(raw)}")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    max_tokens = None if count_tokens else _max_tokens(body)
    if not count_tokens and body.get("metadata") is not None:
        # vLLM 0.32: dict[str, Any] | None, refused after admission with pydantic's dump
        expect("metadata", body["metadata"], (dict,), "an object")
    effort = _output_effort(body)
    if _thinking(body, max_tokens) == "disabled":
        effort = policy.disabled_thinking_effort
    _check_tool_choice(body)
    tools = _resolve_tools(body, messages)
    choice = body.get("tool_choice")
    if choice is not None and choice.get("type") == "tool" and \
            choice.get("name") not in {t.name for t in tools or []}:
        # the forced tool's schema (vllm/tool_parsers/utils.py get_json_schema_from_tool,
        # from the tool parser's adjust_request, count_tokens too)
        raise BadRequest("tool_choice.name", f"Tool '{choice.get('name')}' has not been "
                                             "passed in `tools`.")

    out: list[dict[str, Any]] = []
    system = _system_parts(body)
    if policy.merge_inline_system:
        system += [t for m in messages if m.role == "system" and (t := _system_text(m))]
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for m in messages:
        if m.role == "system":
            text = None if policy.merge_inline_system else _system_text(m)
            if text:
                out.append({"role": "system", "content": text})
            continue
        _convert_message(m, policy, out)
    if not out:
        raise BadRequest("messages", "nothing to count: no system prompt and no message "
                                     "with content")
    chat: dict[str, Any] = {"messages": out}
    if tools is not None:
        chat["tools"] = [_chat_tool(t) for t in tools]
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return ChatRequest(chat, max_tokens)


# -- what vLLM derives from the template at start ------------------------------------------

def requires_system_first(source: str | None) -> bool:
    """Whether inline system messages are merged into the leading one: vLLM's
    ``_detect_merge_inline_system`` renders [system, user, system, user] in a bare
    jinja sandbox (trim_blocks, lstrip_blocks, loopcontrols; none of transformers'
    globals) without a generation prompt, and merges when that raises."""
    if not source:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    turns = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(source).render(messages=turns, add_generation_prompt=False)
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError):
        # vLLM catches TemplateError; anything else would stop its start
        return True
    return False


def disabled_thinking_effort(render: Callable[[str], str | None]) -> str:
    """vLLM's ``_probe_disabled_thinking_effort``: ``"low"`` when the prompt of a "Hi"
    user turn with ``reasoning_effort="none"`` fails to render (``render`` gives None)
    or equals the prompt with one of the thinking efforts, else ``"none"``.
    ``render(effort)``: that prompt's text, or None when it fails."""
    none_prompt = render("none")
    if none_prompt is None:
        return "low"
    return "low" if any(render(e) == none_prompt for e in EFFORTS) else "none"
