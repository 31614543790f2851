"""OpenAI Responses bodies (``POST /v1/responses``) as the chat request vLLM 0.32 makes
of them.

vLLM's non-harmony Responses serving (the path of Qwen and every model that is not
gpt-oss) builds chat messages from the body and renders them with the chat path
(``vllm/renderers/online_renderer.py`` ``render_responses``, calling
``vllm/entrypoints/openai/responses/utils.py`` ``construct_input_messages`` and
``construct_tool_dicts``, then ``preprocess_chat``). ``to_chat`` does that conversion
in our own terms and hands back the OpenAI chat body that ``ModelCounter``'s chat path
counts:

- ``instructions`` (when not empty) becomes a leading system message;
- ``input`` as a string becomes one user message; as items
  (``construct_chat_messages_with_tool_call``, ``_construct_message_from_response_item``):
  a message item of role user / system / developer passes on as it is (its
  ``input_text`` parts are text parts of the chat path); an assistant message becomes
  an assistant message holding the text of its FIRST content part only (vLLM reads
  ``content[0].text``); a ``function_call`` (``custom_tool_call``) item a tool call
  whose name is ``namespace + "__" + name`` when it has a namespace (a custom call's
  arguments ``{"input": ...}`` as JSON); a ``reasoning`` item the assistant's
  ``reasoning`` (its first ``content`` text, else its first summary text); a
  ``function_call_output`` (``custom_tool_call_output``) item a tool message. Tool
  calls, reasoning and text that follow an assistant message are merged into it while
  it has no such field yet;
- ``tools`` (``construct_tool_dicts``, ``iter_response_function_tool_dicts``): function
  tools become chat function tools (``{"type": "function", "function": {name,
  description, parameters, [strict], [defer_loading]}}``), a namespace's functions are
  flattened to ``<namespace>__<name>``, a custom tool becomes a function with one
  string parameter ``input``; built-in tools (web search, file search, MCP, ...) are
  not shown to the model; ``tool_choice`` never changes the prompt (vLLM's
  ``--exclude-tools-when-tool-choice-none`` assumed off);
- ``reasoning.effort`` sets ``reasoning_effort`` (and through it ``enable_thinking``,
  as ``ResponsesRequest.build_chat_params``); a last message or reasoning item whose
  status is ``in_progress`` or ``incomplete`` is continued
  (``should_continue_final_message``: no generation prompt);
- ``chat_template_kwargs`` (a vLLM extension) passes on to the chat path.

``previous_response_id`` names a response in vLLM's own store, which the counter
cannot see: a body with one is counted for what it holds, without the stored
history (the edge marks such a count an estimate and settles from vLLM's usage).

Validation follows vLLM's request model (``vllm/entrypoints/openai/responses/
protocol.py`` ``ResponsesRequest``, its ``input_item_parsing`` and ``check_tool_usage``
validators): what they refuse and this module reads is refused with ``BadRequest``
naming the field ("input[2].content[0].type: ..."). Image and file parts are refused:
the counter's models read text only. Items vLLM fails on with a server error (an
assistant message without content or led by a refusal part, an ``item_reference``)
are refused too. ``max_output_tokens`` is the completion budget (an integer >= 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokengate.counter.errors import BadRequest, expect, type_name
from tokengate.counter.fields import REASONING_EFFORTS, opt_choice

ROLES = ("user", "system", "developer", "assistant")
# ResponseInputContentParam and the easy message's assistant parts
INPUT_PART_TYPES = frozenset({"input_text", "input_image", "input_file"})
OUTPUT_PART_TYPES = frozenset({"output_text", "refusal"})
# Responses tools that are never shown to the model (get_function_tools drops them)
BUILTIN_TOOLS = frozenset({"file_search", "web_search", "web_search_preview",
                           "web_search_2025_08_26", "web_search_preview_2025_03_11",
                           "computer_use_preview", "computer", "mcp", "code_interpreter",
                           "image_generation", "local_shell", "shell", "apply_patch",
                           "tool_search", "container"})
# fields vLLM 0.32's ResponsesRequest types as literals (or an object of them): another
# value was refused there after admission, with pydantic's dump
TRUNCATIONS = ("auto", "disabled")
INCLUDABLES = ("code_interpreter_call.outputs", "computer_call_output.output.image_url",
               "file_search_call.results", "message.input_image.image_url",
               "message.output_text.logprobs", "reasoning.encrypted_content")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
# reasoning.* besides effort: the literals of openai's Reasoning
REASONING_LITERALS = {"summary": ("auto", "concise", "detailed"),
                      "generate_summary": ("auto", "concise", "detailed"),
                      "context": ("auto", "current_turn", "all_turns")}
TEXT_FORMATS = ("text", "json_schema", "json_object")
PARTIAL_STATUSES = ("in_progress", "incomplete")
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string",
                             "description": "The freeform text payload for this tool."}},
    "required": ["input"], "additionalProperties": False}


@dataclass(frozen=True)
class ChatRequest:
    """A Responses body converted: the OpenAI chat body the chat path counts (messages,
    tools, reasoning_effort, add_generation_prompt, continue_final_message,
    chat_template_kwargs) and the body's ``max_output_tokens`` (None when absent)."""

    body: dict[str, Any]
    max_output_tokens: int | None


def _req_str(obj: dict[str, Any], key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise BadRequest(f"{where}.{key}", f"required string, got {type_name(v)}")
    return v


def _opt(obj: dict[str, Any], key: str, where: str, kinds: tuple[type, ...],
         what: str) -> Any:
    v = obj.get(key)
    if v is not None:
        expect(f"{where}.{key}", v, kinds, what)
    return v


def _status(item: dict[str, Any], where: str) -> None:
    status = item.get("status")
    if status is not None and status not in ITEM_STATUSES:
        raise BadRequest(f"{where}.status", "expected one of " + ", ".join(ITEM_STATUSES))


def _refuse_media(where: str) -> BadRequest:
    return BadRequest(where, "image and file content is not supported: this model reads "
                             "text only")


# -- items (vllm/entrypoints/openai/responses/utils.py) -----------------------------------

def _part_type(where: str, part: Any, allowed: frozenset[str]) -> str:
    """The type of the content part at ``where``: an object whose ``type`` is one of
    ``allowed``, else ``BadRequest``."""
    expect(where, part, (dict,), "a content part object")
    kind = part.get("type")
    if not (isinstance(kind, str) and kind in allowed):
        raise BadRequest(f"{where}.type", f"unknown content part type {kind!r}; expected "
                                          "one of " + ", ".join(sorted(allowed)))
    return kind


def _input_parts(where: str, content: list[Any]) -> list[dict[str, Any]]:
    """A user / system / developer message's parts (``ResponseInputContentParam``)."""
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        if _part_type(pwhere, part, INPUT_PART_TYPES) != "input_text":
            raise _refuse_media(pwhere)
        _req_str(part, "text", pwhere)
    return content


def _assistant_text(where: str, item: dict[str, Any]) -> str:
    """The text vLLM keeps of an assistant message: its content, or its first part's."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content", f"expected a string or an array of content "
                                             f"parts, got {type_name(content)}")
    output = item.get("type") == "message"  # parsed as ResponseOutputMessage
    allowed = OUTPUT_PART_TYPES | INPUT_PART_TYPES if output else INPUT_PART_TYPES
    for j, part in enumerate(content):
        pwhere = f"{where}.content[{j}]"
        kind = _part_type(pwhere, part, allowed)
        if kind in ("input_image", "input_file"):
            raise _refuse_media(pwhere)
        _req_str(part, "refusal" if kind == "refusal" else "text", pwhere)
        if kind == "output_text":
            _opt(part, "annotations", pwhere, (list,), "an array")
    if not content:
        raise BadRequest(f"{where}.content", "an assistant message needs a content part")
    if content[0]["type"] == "refusal":
        raise BadRequest(f"{where}.content[0].type", "a refusal part cannot lead an "
                                                     "assistant message of the input")
    if output:
        _status(item, where)
    return str(content[0]["text"])


def _tool_call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """A function_call or custom_tool_call item as a chat tool call."""
    call_id = _req_str(item, "call_id", where)
    name = _req_str(item, "name", where)
    if item["type"] == "function_call":
        arguments = _req_str(item, "arguments", where)
        namespace = _opt(item, "namespace", where, (str,), "a string")
        if namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        _status(item, where)
    else:
        arguments = json.dumps({"input": _req_str(item, "input", where)}, ensure_ascii=False)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _tool_output(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """A function_call_output or custom_tool_call_output item as a tool message."""
    call_id = _req_str(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, list):
        _input_parts(f"{where}.output", output)
    elif not isinstance(output, str):
        raise BadRequest(f"{where}.output", f"required string or array of content parts, "
                                            f"got {type_name(output)}")
    return {"role": "tool", "content": output, "tool_call_id": call_id}


def _reasoning(where: str, item: dict[str, Any]) -> str:
    """A reasoning item's text: its first content text, else its first summary text."""
    summary = item.get("summary")
    if not isinstance(summary, list):
        raise BadRequest(f"{where}.summary", f"expected an array of summary parts, got "
                                             f"{type_name(summary)}")
    for k, s in enumerate(summary):
        expect(f"{where}.summary[{k}]", s, (dict,), "an object")
        if s.get("type") != "summary_text":
            raise BadRequest(f"{where}.summary[{k}].type", "expected 'summary_text'")
        _req_str(s, "text", f"{where}.summary[{k}]")
    content = _opt(item, "content", where, (list,), "an array of reasoning text parts")
    for k, c in enumerate(content or []):
        expect(f"{where}.content[{k}]", c, (dict,), "an object")
        if c.get("type") != "reasoning_text":
            raise BadRequest(f"{where}.content[{k}].type", "expected 'reasoning_text'")
        _req_str(c, "text", f"{where}.content[{k}]")
    _status(item, where)
    if item.get("encrypted_content"):
        raise BadRequest(f"{where}.encrypted_content", "encrypted reasoning is not supported")
    if content:
        return str(content[0]["text"])
    return str(summary[0]["text"]) if summary else ""


def _merge(prev: dict[str, Any] | None, key: str, value: Any) -> bool:
    """Sets ``key`` of the previous assistant message when it has none (vLLM's merge of
    consecutive items into one assistant turn); whether it did."""
    if prev is None or prev.get("role") != "assistant" or prev.get(key) is not None:
        return False
    prev[key] = value
    return True


def _item_messages(items: list[Any]) -> list[dict[str, Any]]:
    """``construct_chat_messages_with_tool_call``: chat messages of ``input`` items."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        expect(where, item, (dict,), "an input item object")
        kind = item.get("type")
        prev = out[-1] if out else None
        if kind in ("function_call", "custom_tool_call"):
            call = _tool_call(where, item)
            if prev is not None and prev.get("role") == "assistant":
                calls = prev.get("tool_calls")
                if calls is None:
                    prev["tool_calls"] = [call]
                    continue
                calls.append(call)
                continue
            out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "reasoning":
            text = _reasoning(where, item)
            if not _merge(prev, "reasoning", text):
                out.append({"role": "assistant", "reasoning": text})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append(_tool_output(where, item))
        elif kind is None or kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise BadRequest(f"{where}.role", f"expected one of {', '.join(ROLES)}, got "
                                                  + (repr(role) if isinstance(role, str)
                                                     else type_name(role)))
            if role == "assistant":
                text = _assistant_text(where, item)
                if not _merge(prev, "content", text):
                    out.append({"role": "assistant", "content": text})
                continue
            content = item.get("content")
            if isinstance(content, list):
                _input_parts(f"{where}.content", content)
            elif not isinstance(content, str):
                raise BadRequest(f"{where}.content", "required string or array of content "
                                                     f"parts, got {type_name(content)}")
            _status(item, where)
            out.append(dict(item))
        elif isinstance(kind, str):
            raise BadRequest(f"{where}.type", f"input item type {kind!r} is not supported")
        else:
            raise BadRequest(f"{where}.type", f"expected a string, got {type_name(kind)}")
    return out


def _continues(items: list[Any]) -> bool:
    """``should_continue_final_message``: the last item is a partial message or
    reasoning item."""
    if not items:
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") \
        and last.get("status") in PARTIAL_STATUSES


# -- tools ---------------------------------------------------------------------------------

def _function(where: str, t: dict[str, Any], name: str) -> dict[str, Any]:
    """A ``FunctionTool`` as ``ChatCompletionToolsParam.model_dump()`` gives it."""
    desc = _opt(t, "description", where, (str,), "a string")
    params = _opt(t, "parameters", where, (dict,), "an object")
    strict = _opt(t, "strict", where, (bool,), "a boolean")
    defer = _opt(t, "defer_loading", where, (bool,), "a boolean")
    fn: dict[str, Any] = {"name": name, "description": desc, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    if defer is not None:
        fn["defer_loading"] = defer
    return {"type": "function", "function": fn}


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, set[str]]:
    """(``construct_tool_dicts``' chat tools or None, the names a tool_choice may name)."""
    raw = body.get("tools")
    if raw is None:
        return None, set()
    expect("tools", raw, (list,), "an array of tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        expect(where, t, (dict,), "a tool object")
        kind = t.get("type")
        if kind == "function":
            name = _req_str(t, "name", where)
            out.append(_function(where, t, name))
            names.add(name)
        elif kind == "namespace":
            ns = _req_str(t, "name", where)
            inner = t.get("tools")
            expect(f"{where}.tools", inner, (list,), "an array of tools")
            for k, f in enumerate(inner):
                fwhere = f"{where}.tools[{k}]"
                expect(fwhere, f, (dict,), "a tool object")
                if f.get("type") == "function":
                    name = f"{ns}{NAMESPACE_SEPARATOR}{_req_str(f, 'name', fwhere)}"
                    out.append(_function(fwhere, f, name))
                    names.add(name)
        elif kind == "custom":
            name = _req_str(t, "name", where)
            fmt = t.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                raise BadRequest(f"{where}.format", "custom tools with a grammar format are "
                                                    "not supported")
            desc = _opt(t, "description", where, (str,), "a string")
            out.append({"type": "function", "function": {
                "name": name, "description": desc, "parameters": CUSTOM_TOOL_PARAMETERS}})
            names.add(name)
        elif isinstance(kind, str) and kind in BUILTIN_TOOLS:
            continue
        else:
            raise BadRequest(f"{where}.type", f"unknown tool type {kind!r}")
    return (out if raw else None), names


def _check_tool_choice(body: dict[str, Any], names: set[str]) -> None:
    """``check_tool_usage``: tool_choice changes no prompt token, only checked."""
    choice = body.get("tool_choice", "auto")
    has_tools = bool(body.get("tools"))
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadRequest("tool_choice", "expected 'auto', 'none', 'required' or an object")
        if choice == "required" and not has_tools:
            raise BadRequest("tool_choice", "'required' must be specified with tools")
        return
    expect("tool_choice", choice, (dict,), "a string or an object")
    if choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not has_tools or not name or not isinstance(name, str) or not (
                name in names or sum(n.endswith(NAMESPACE_SEPARATOR + name)
                                     for n in names) == 1):
            raise BadRequest("tool_choice.name", "tool choice not found in tools")


def _effort(body: dict[str, Any]) -> str | None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    expect("reasoning", reasoning, (dict,), "an object")
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest("reasoning.effort", "expected one of " + ", ".join(REASONING_EFFORTS))
    # vLLM answers anything else with a pydantic dump (measured for summary)
    for field, choices in REASONING_LITERALS.items():
        value = reasoning.get(field)
        if value is not None and value not in choices:
            raise BadRequest(f"reasoning.{field}", "expected one of " + ", ".join(choices))
    return effort


def _check_options(body: dict[str, Any]) -> None:
    """The request options vLLM's ResponsesRequest types narrowly and no prompt token
    depends on: truncation, include, service_tier, metadata (strings), text.format
    (openai's ResponseTextConfig: a type of TEXT_FORMATS, json_schema with its name and
    schema object)."""
    opt_choice(body, "truncation", TRUNCATIONS)
    include = body.get("include")
    if include is not None:
        expect("include", include, (list,), "an array")
        for i, v in enumerate(include):
            if v not in INCLUDABLES:
                raise BadRequest(f"include[{i}]", "expected one of " + ", ".join(INCLUDABLES))
    opt_choice(body, "service_tier", SERVICE_TIERS)  # null: the edge drops it
    metadata = body.get("metadata")
    if metadata is not None:
        expect("metadata", metadata, (dict,), "an object")
        for k, v in metadata.items():
            expect(f"metadata.{k}", v, (str,), "a string")
    text = body.get("text")
    if text is None:
        return
    expect("text", text, (dict,), "an object")
    fmt = text.get("format")
    if fmt is None:
        return
    expect("text.format", fmt, (dict,), "an object")
    kind = fmt.get("type")
    if kind not in TEXT_FORMATS:
        got = repr(kind) if isinstance(kind, str) else type_name(kind)
        raise BadRequest("text.format.type", "expected one of "
                         f"{', '.join(map(repr, TEXT_FORMATS))}, got {got}")
    if kind == "json_schema":
        expect("text.format.name", fmt.get("name"), (str,), "a string")
        expect("text.format.schema", fmt.get("schema"), (dict,), "an object")


def _max_output_tokens(body: dict[str, Any]) -> int | None:
    v = body.get("max_output_tokens")
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest("max_output_tokens", f"expected an integer, got {type_name(v)}")
    if v < 1:
        raise BadRequest("max_output_tokens", f"must be at least 1, got {v}")
    return v


def to_chat(body: dict[str, Any]) -> ChatRequest:
    """The chat request vLLM's non-harmony Responses serving makes of ``body`` (parsed
    JSON of ``POST /v1/responses``): ``render_responses``' ``construct_input_messages``
    and ``construct_tool_dicts`` with no stored history.

    Raises ``BadRequest`` naming the field of the Responses body.
    """
    if "input" not in body:
        raise BadRequest("input", "required string or array of input items")
    raw = body["input"]
    instructions = body.get("instructions")
    if instructions is not None:
        expect("instructions", instructions, (str,), "a string")
    if body.get("prompt") is not None:
        raise BadRequest("prompt", "prompt templates are not supported")
    if body.get("previous_input_messages") and body.get("previous_response_id"):
        raise BadRequest("previous_response_id", "only one of previous_input_messages and "
                                                 "previous_response_id can be set")
    if body.get("previous_response_id") is not None:
        expect("previous_response_id", body["previous_response_id"], (str,), "a string")
    if body.get("background") and body.get("store", True) is False:
        raise BadRequest("background", "background can only be used when store is true")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        cont = False
    elif isinstance(raw, list):
        messages += _item_messages(raw)
        cont = _continues(raw)
    else:
        raise BadRequest("input", f"expected a string or an array of input items, got "
                                  f"{type_name(raw)}")
    if not messages:
        raise BadRequest("input", "nothing to count: no instructions and no input item")
    _check_options(body)
    tools, names = _tools(body)
    _check_tool_choice(body, names)
    effort = _effort(body)
    chat: dict[str, Any] = {"messages": messages, "add_generation_prompt": not cont,
                            "continue_final_message": cont}
    if tools is not None:
        chat["tools"] = tools
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return ChatRequest(chat, _max_output_tokens(body))
