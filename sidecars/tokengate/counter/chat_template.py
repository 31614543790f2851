"""The served model's chat template, rendered the way vLLM renders it.

vLLM (0.32, ``vllm/renderers/hf.py`` ``safe_apply_chat_template``) calls
``tokenizer.apply_chat_template(conversation, tools=..., tokenize=True, **kwargs)``;
transformers renders with ``render_jinja_template`` (``transformers/utils/
chat_template_utils.py``) passing the tokenizer's ``special_tokens_map`` plus the
kwargs, then tokenizes the text with ``add_special_tokens=False``. We call the same
transformers function on the same template text, so the rendered prompt is identical
by construction; the conversation it receives is built by ``counting.py`` with vLLM's
message preprocessing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from tokengate.counter import template_trace
from tokengate.counter.model_files import chat_template_source

ContentFormat = Literal["string", "openai"]

# Keys of tokenizer.apply_chat_template that change tokenization, not rendering, or
# collide with arguments vLLM sets itself; a request may not pass them in
# chat_template_kwargs (vLLM forwards some of them to the tokenizer).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation",
    "conversations", "messages",
})
# tokenizer.apply_chat_template's own parameters: vLLM passes these through even when
# the template does not mention them (``_get_hf_base_chat_template_params``).
HF_APPLY_PARAMS = frozenset({"tools", "documents", "add_generation_prompt",
                             "continue_final_message"})


def _transformers_renderer() -> Any:
    """transformers' ``render_jinja_template``, imported when a template that needs
    transformers' own extensions (``{% generation %}``) loads: about 1.8 s of CPU, which
    every other counter start and ``tokengate doctor`` saves. Imported on a request's
    first need it stalled that worker's socket for seconds, so the edge's count
    deadline passed and its breaker opened for every request (a loaded machine's
    first ``continue_final_message`` request): nothing imports it there any more.

    transformers' import says "PyTorch was not found. Models won't be available ..." on
    every start of a base install, which has no torch on purpose (tokengate renders
    templates with it, nothing else). That line is transformers' only advisory warning
    (``logger.warning_advice``, which returns at each call while this variable is set;
    5.x); its other warnings are left as they are, and a value the operator set is kept.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template


# appended to the final message's text when it is continued: the prompt ends where it
# lands (transformers' ``render_jinja_template``, the one vLLM renders with)
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(ValueError):
    """The template raised while rendering (e.g. ``raise_exception``) or cannot load."""


def _is_content_access(node: jinja2.nodes.Node, varname: str) -> bool:
    """``varname.content`` or ``varname['content']``."""
    if isinstance(node, jinja2.nodes.Getattr):
        return (node.attr == "content" and isinstance(node.node, jinja2.nodes.Name)
                and node.node.name == varname)
    if isinstance(node, jinja2.nodes.Getitem):
        return (isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
                and isinstance(node.node, jinja2.nodes.Name) and node.node.name == varname)
    return False


def _message_loop_vars(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loop variables of ``for m in messages`` (also ``messages[::-1]``, filters)."""
    for loop in root.find_all(jinja2.nodes.For):
        it: jinja2.nodes.Node = loop.iter
        while isinstance(it, (jinja2.nodes.Filter, jinja2.nodes.Getitem)) \
                and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Name) and it.name == "messages" \
                and isinstance(loop.target, jinja2.nodes.Name):
            yield loop.target.name


def detect_content_format(template: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content parts, else ``string``.

    Same rule as vLLM's ``_detect_content_format`` (``vllm/renderers/hf.py``): a
    ``for`` over ``message.content`` (or a variable named ``content``) means the
    template wants the list of parts; otherwise vLLM joins text parts with "\\n".
    """
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        root = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    names = set(_message_loop_vars(root))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_content_access(loop.iter, n) for n in names):
            return "openai"
        if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter (chat_template_utils.py): json.dumps, no escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Environment(jinja2.Environment):
    """jinja2's Environment whose ``message.role`` on a plain dict skips the failed
    attribute lookup (an AttributeError raised and caught per access).

    Same result by construction: ``Environment.getattr`` tries ``getattr(obj, name)``
    first, which on a plain dict fails for every name that is not a dict attribute,
    then ``obj[name]``, then returns an undefined.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _fast_environment() -> jinja2.Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True,
                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    template_trace.wrap_environment(env)
    return env


class ChatTemplate:
    """One model's chat template plus what vLLM derives from it.

    Attributes: ``source`` (template text), ``content_format``, ``variables`` (names
    the template reads), ``supports_developer_role``, ``special_tokens_map``,
    ``why_not_traced`` ("" when conversations are rendered through ``traces``, a
    ``template_trace.TraceCache``).
    """

    def __init__(self, source: str, special_tokens_map: dict[str, Any]) -> None:
        self.source = source
        self.special_tokens_map = special_tokens_map
        self.content_format = detect_content_format(source)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        try:
            root = env.parse(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not parse: {e}") from e
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(root))
        # The template is the operator's (the model directory vLLM loads), so it may run
        # outside jinja's sandbox, which halves rendering time; the environment matches
        # transformers' (trim_blocks, lstrip_blocks, loopcontrols, tojson,
        # raise_exception, strftime_now). Templates that need transformers' own
        # extensions ({% generation %}) render through transformers.
        self._fast: jinja2.Template | None
        try:
            self._fast = _fast_environment().from_string(source)
        except jinja2.TemplateError:
            self._fast = None
            _transformers_renderer()  # imported now, not by the first request
        self.why_not_traced = "needs transformers' renderer" if self._fast is None else \
            "content format openai" if self.content_format == "openai" else \
            template_trace.traceable(root)
        self.traces = template_trace.TraceCache()
        # vLLM: ``_detect_developer_role_support`` looks for the quoted role name.
        self.supports_developer_role = '"developer"' in source or "'developer'" in source

    def _continued(self, conversation: list[dict[str, Any]],
                   render: Callable[[list[dict[str, Any]]], str]) -> str:
        """The prompt of ``conversation`` whose final message the model continues
        (``continue_final_message``): rendered with ``CONTINUE_TAG`` after the final
        message's text (its content, or its last part that has a text), cut where the
        tag lands; when the template trimmed the space after the tag, what precedes the
        tag loses its trailing whitespace too. Behaviour of transformers 5.x
        ``render_jinja_template`` (utils/chat_template_utils.py), which vLLM's
        ``apply_hf_chat_template`` calls; the chat and Responses parity corpora check
        it against vLLM. Raises ``TemplateError`` where transformers raises: the final
        message has no content, or no text part; the template never reads ``content``;
        the rendered prompt lacks the final text or the tag."""
        final = conversation[-1].get("content")
        if final is None:
            raise TemplateError('continue_final_message is set but the final message has '
                                'no "content" to continue!')
        if "content" not in self.source:
            raise TemplateError('continue_final_message is set to "content" but this is '
                                'not an accepted field in the chat_template')
        last = dict(conversation[-1])
        if isinstance(final, (list, tuple)):
            parts = list(final)
            for i in range(len(parts) - 1, -1, -1):
                part = parts[i]
                if isinstance(part, dict) and "text" in part:
                    final = part["text"]
                    if not isinstance(final, str):
                        break  # transformers fails on the concatenation
                    parts[i] = {**part, "text": final + CONTINUE_TAG}
                    break
            else:
                raise TemplateError("continue_final_message is set but we could not find "
                                    "any text to continue in the final message!")
            last["content"] = parts
        elif isinstance(final, str):
            last["content"] = final + CONTINUE_TAG
        if not isinstance(final, str):
            raise TemplateError("continue_final_message: the text to continue is not a "
                                "string")
        text = render([*conversation[:-1], last])
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TemplateError("continue_final_message is set but the final message does "
                                "not appear in the chat after applying the chat template!")
        at = text.rindex(tag)
        return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate:
        """Template from ``chat_template.jinja`` or ``tokenizer_config.json`` (as transformers).

        Raises ``TemplateError`` when the directory defines none.
        """
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        source = chat_template_source(model_dir)
        if source is None:
            raise TemplateError(f"{model_dir}: no chat template")
        special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token",
                                        "additional_special_tokens")
                   if cfg.get(k) is not None}
        for k, v in list(special.items()):
            if isinstance(v, dict):  # serialized AddedToken
                special[k] = v.get("content")
        return cls(source, special)

    def accepts(self, kwarg: str) -> bool:
        """Whether vLLM passes ``kwarg`` from chat_template_kwargs to the template."""
        return kwarg in self.variables or kwarg in HF_APPLY_PARAMS

    def render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any]) -> str:
        """The prompt text (``prompt``'s). Raises ``TemplateError``."""
        return self.prompt(conversation, tools, kwargs).text

    def prompt(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any]) -> template_trace.Rendered:
        """The prompt. ``kwargs`` holds add_generation_prompt, continue_final_message,
        documents and template variables. A conversation of plain messages without tools
        or documents is assembled from ``traces`` once a conversation of its shape was
        rendered (``template_trace``: the same text; the result then names the trace).
        Raises ``TemplateError``.
        """
        args = {**self.special_tokens_map, **kwargs}
        if self._fast is not None:
            cont = args.pop("continue_final_message", False)
            args.setdefault("add_generation_prompt", False)
            args.setdefault("documents", None)
            fast = self._fast

            def render(messages: list[dict[str, Any]]) -> str:
                try:
                    return fast.render(messages=messages, tools=tools, **args)
                except Exception as e:  # a template may raise anything from user input
                    raise TemplateError(str(e) or type(e).__name__) from e
            if cont:
                self.traces.count_plain()
                return template_trace.Rendered(self._continued(conversation, render))
            key = None if tools is not None or self.why_not_traced or args["documents"] \
                is not None else template_trace.shape_key(conversation, kwargs)
            if key is None:
                self.traces.count_plain()
                return template_trace.Rendered(render(conversation))
            return self.traces.render(key, conversation, render)
        self.traces.count_plain()
        try:
            rendered, _ = _transformers_renderer()(  # type: ignore[str-unpack]
                conversations=[conversation], tools=tools,  # type: ignore[arg-type]
                chat_template=self.source, **args)
        except Exception as e:  # a template may raise anything from user input
            raise TemplateError(str(e) or type(e).__name__) from e
        return template_trace.Rendered(str(rendered[0]))
