"""Prompt tokens of a request body, exactly as vLLM 0.32 will count them.
(Over 600 lines: chat and completions share one segment plan, one encoder and one
cache, proven together by the parity tests; each other API's conversion to them is a
module of its own in ``counter/apis``.)

Chat (``/v1/chat/completions``): the messages become vLLM's "conversation" with its
preprocessing (``vllm/renderers/chat_utils.py`` ``_parse_chat_message_content`` and
``_postprocess_messages``; ``vllm/renderers/hf.py`` developer-role handling), the tools
become ``ChatCompletionToolsParam.model_dump()`` dicts, the template kwargs (only the
keys of ``edge.chat_template_kwargs_allowed``) are merged like
``ChatCompletionRequest.build_chat_params``; the chat template renders the text and
the tokenizer counts it without added special tokens.

Completions (``/v1/completions``): a string prompt is tokenized with the tokenizer's
post-processor specials (Qwen adds none) unless ``add_special_tokens`` is false; a
token-id list counts its ids; a list of prompts counts each (vLLM reports the sum as
``usage.prompt_tokens``).

Embeddings (``/v1/embeddings``, a pooling model): ``input``'s prompts, each counted as a
completions prompt is, then vLLM's pooling tokenization rules
(``tokengate.counter.apis.openai_embeddings``); vLLM reports the sum as
``usage.prompt_tokens``.

Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``): the body is
converted into a chat body the way vLLM's Anthropic serving converts it
(``tokengate.counter.apis.anthropic_messages``), which the chat path above counts; vLLM
reports that count as ``usage.input_tokens`` (less any prefix-cache hits, which it
reports apart as ``cache_read_input_tokens``) and as count_tokens' ``input_tokens``.

OpenAI Responses (``/v1/responses``): the body is converted into a chat body the way
vLLM's non-harmony Responses serving builds its prompt
(``tokengate.counter.apis.openai_responses``), which the chat path counts; vLLM reports
that count as ``usage.input_tokens`` (prefix-cache hits included, told apart in
``input_tokens_details.cached_tokens``).

Prefix-cache routing (``routing.policy: prefix``): the prompt's token ids, which the
count alone never materializes, are assembled from cached ids per text piece
(``PromptTokenizer.ids``: the ids vLLM gets, as its count is) and given to
``prefix_routing.PrefixRouter``, whose block hashes and per-replica hits go in the
result. Which prompt: chat, Messages and Responses the rendered prompt; completions the
first prompt (a string, or token ids as given; a list of prompts is routed by its first,
so the hits are a lower bound of the request's); none for count_tokens and embeddings
(nothing is generated), nor when ``truncate_prompt_tokens`` cut the prompt. A request's
``cache_salt`` (chat, completions, Messages, Responses; checked as vLLM checks it) goes
into block 0's hash.

Every malformed field raises ``BadRequest`` whose ``param`` names it
(``messages[2].content``).

(Over 600 lines: the chat path, vLLM's preprocessing of messages, tools and template
arguments mirrored step by step, is one unit that every chat-shaped API reaches through.)
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokengate.config import EdgeConfig, ModelConfig
from tokengate.counter import segment_plan
from tokengate.counter.apis import anthropic_messages, openai_embeddings, openai_responses
from tokengate.counter.chat_template import RESERVED_TEMPLATE_KWARGS, ChatTemplate, TemplateError
from tokengate.counter.errors import BadRequest, expect, expect_name, type_name
from tokengate.counter.fields import REASONING_EFFORTS, opt_bool, opt_choice, opt_int
from tokengate.counter.kv_index import ModelIndex
from tokengate.counter.model_files import encoder_do_lower_case
from tokengate.counter.prefix_routing import PrefixRouter
from tokengate.counter.tokenizer import PromptTokenizer

# vLLM releases (major, minor; any patch level) whose preprocessing this module mirrors
# and the parity tests ran against; `tokengate doctor` refuses other upstreams by default.
VERIFIED_VLLM: tuple[tuple[int, int], ...] = ((0, 32),)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Roles whose message of a role and a string content only is kept as it is.
_PLAIN_ROLES = frozenset({"system", "user", "assistant", "tool"})
# vLLM's TEXT_PART_TYPES and the field holding each part's text.
TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text",
                    "refusal": "refusal", "thinking": "thinking"}
_CLAUDE_BILLING_HEADER = "x-anthropic-billing-header"
# Anthropic Messages: /v1/messages and /v1/messages/count_tokens (apis.anthropic_messages)
MESSAGES_ENDPOINTS = frozenset({"messages", "count_tokens"})
_MAX_JSON_DEPTH = 64
# vLLM's check of cache_salt (vllm/entrypoints/generate/base/protocol.py
# validate_cache_salt: chat, completions, Responses, and Messages through its chat request)
_MAX_CACHE_SALT = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


@dataclass(frozen=True)
class Breakdown:
    """Prompt tokens by origin; the four parts add up to the prompt tokens."""

    system: int = 0
    tools: int = 0
    messages: int = 0
    template_overhead: int = 0


@dataclass(frozen=True)
class CountResult:
    """What the counter answers for one body (tokens)."""

    prompt_tokens: int
    max_model_len: int
    max_tokens_effective: int
    max_tokens_requested: int
    breakdown: Breakdown
    prompt_count: int = 1
    # prefix-cache routing (routing.policy prefix): prefix_routing.PrefixRouter.route
    block_hashes: bytes = b""
    block_size: int = 0
    prefix_hits: tuple[tuple[str, int], ...] = ()


def _cache_salt(body: dict[str, Any]) -> str | None:
    """The request's ``cache_salt``, checked as vLLM checks it (None: absent or null)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise BadRequest("cache_salt", "must be a non-empty string if provided")
    if len(salt) > _MAX_CACHE_SALT or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise BadRequest("cache_salt", f"must be at most {_MAX_CACHE_SALT} characters and "
                                       "must not contain '@', '/', '\\', or NUL")
    return salt


def _required_str(obj: dict[str, Any], key: str, where: str, what: str) -> None:
    """``BadRequest`` unless ``obj[key]`` is a string: "required string<what>" when it is
    absent, "expected a string<what>, got <type>" when it is something else."""
    if key not in obj:
        raise BadRequest(f"{where}.{key}", f"required string{what}")
    expect(f"{where}.{key}", obj[key], (str,), f"a string{what}")


def _depth_ok(body: Any) -> bool:
    """No value of parsed JSON ``body`` lies deeper than ``_MAX_JSON_DEPTH`` (the body
    itself at depth 0); level by level, without recursion."""
    level = [body] if isinstance(body, (dict, list)) else []
    for _ in range(_MAX_JSON_DEPTH):
        # only the containers go down a level (json.loads makes exact dicts and lists)
        deeper = [x for v in level for x in (v.values() if type(v) is dict else v)
                  if type(x) is dict or type(x) is list]
        if not deeper:
            return True
        level = deeper
    return not any(level)


class ModelCounter:
    """Counts request bodies for one served model (tokenizer + chat template + limits).

    ``template_kwargs_allowed``: the chat_template_kwargs keys a request may pass
    (``edge.chat_template_kwargs_allowed``, the list the edge applies too).
    ``kv_index``: with ``routing.policy`` prefix, the replicas whose KV events this
    process follows (``kv_index.KvEvents``), for the results' ``prefix_hits``.
    """

    def __init__(self, model: ModelConfig, tokenizer: PromptTokenizer,
                 template: ChatTemplate | None,
                 template_kwargs_allowed: Iterable[str],
                 kv_index: ModelIndex | None = None) -> None:
        self.model = model
        self.router = PrefixRouter(model.routing, kv_index) \
            if model.routing.reads_prefix else None
        if self.router is not None:
            tokenizer.keep_ids()  # every prompt's ids are needed: its counts are theirs
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs_allowed = frozenset(template_kwargs_allowed)
        self._string_content = template is not None and template.content_format == "string"
        # Identifies what counted: tokenizer.json digest + chat template digest.
        template_digest = "none" if template is None else \
            hashlib.sha256(template.source.encode()).hexdigest()[:8]
        self.fingerprint = f"{tokenizer.fingerprint}-{template_digest}"
        self._messages_template_policy: anthropic_messages.TemplatePolicy | None = None
        # pooling requests' text is lower-cased first for some encoders (model_files)
        self.lower_case = encoder_do_lower_case(model.dir)

    @classmethod
    def load(cls, model: ModelConfig,
             template_kwargs_allowed: Iterable[str] | None = None,
             kv_index: ModelIndex | None = None) -> ModelCounter:
        """Load tokenizer and chat template from the model's directory.

        ``template_kwargs_allowed``: None for the schema's default of
        ``edge.chat_template_kwargs_allowed``; ``kv_index``: as for the constructor.
        """
        tok = PromptTokenizer.from_model_dir(model.dir, model.vocab)
        try:
            template: ChatTemplate | None = ChatTemplate.from_model_dir(model.dir)
        except TemplateError:
            template = None
        if template_kwargs_allowed is None:
            template_kwargs_allowed = EdgeConfig().chat_template_kwargs_allowed
        return cls(model, tok, template, template_kwargs_allowed, kv_index)

    # -- entry point ---------------------------------------------------------------------

    def count(self, endpoint: str, body: dict[str, Any]) -> CountResult:
        """Count ``body`` (parsed JSON) for ``endpoint`` "chat", "completions",
        "messages", "count_tokens" (``/v1/messages/count_tokens``), "responses" or
        "embeddings".

        Raises ``BadRequest`` (``ContextLengthExceeded`` for an embeddings input longer
        than the context). With prefix routing, the result carries the prompt's block
        hashes and hits (the module docstring says which prompt).
        """
        if not _depth_ok(body):
            raise BadRequest("", f"JSON nesting deeper than {_MAX_JSON_DEPTH} levels")
        ids: array[int] | None = None
        if endpoint == "chat":
            prompt_tokens, breakdown, ids = self._count_chat(body)
            requested = opt_int(body, "max_completion_tokens", 1)
            if requested is None:
                requested = opt_int(body, "max_tokens", 1)
            n_prompts = 1
        elif endpoint in MESSAGES_ENDPOINTS:
            return self._count_messages(body, count_tokens=endpoint == "count_tokens")
        elif endpoint == "responses":
            return self._count_responses(body)
        elif endpoint == "embeddings":
            return self._count_embeddings(body)
        elif endpoint == "completions":
            prompt_tokens, n_prompts, biggest = self._count_completions(body)
            breakdown = Breakdown(messages=prompt_tokens)
            if self.router is not None:
                # counted, so well-formed, and its pieces' ids cached (keep_ids)
                ids = self._first_prompt_ids(body["prompt"],
                                             opt_bool(body, "add_special_tokens", True))
            # OpenAI/vLLM completions default max_tokens to 16.
            requested = opt_int(body, "max_tokens", 1) if "max_tokens" in body else 16
            prompt_tokens_for_room = biggest
        else:
            raise BadRequest("endpoint", f"unknown endpoint {endpoint!r}")
        if requested is not None and requested > self.model.max_model_len:
            # vLLM: "max_tokens=N cannot be greater than max_model_len=M" (400).
            param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
                and endpoint == "chat" else "max_tokens"
            raise BadRequest(param, f"{requested} is greater than max_model_len "
                                    f"{self.model.max_model_len}")
        truncate = opt_int(body, "truncate_prompt_tokens", -1)
        if truncate is not None:
            if truncate > self.model.max_model_len:
                raise BadRequest("truncate_prompt_tokens",
                                 f"{truncate} is greater than max_model_len "
                                 f"{self.model.max_model_len}")
            limit = self.model.max_model_len - 1 if truncate == -1 else truncate
            if prompt_tokens > limit * n_prompts:
                prompt_tokens = limit * n_prompts
                breakdown = _fit(breakdown, prompt_tokens)
                ids = None  # vLLM hashes what is left: not routed
        if endpoint == "chat":
            prompt_tokens_for_room = prompt_tokens
        room = max(0, self.model.max_model_len - prompt_tokens_for_room)
        effective = room if requested is None else min(requested, room)
        return CountResult(prompt_tokens, self.model.max_model_len, effective,
                           requested or 0, breakdown, n_prompts, *self._route(ids, body))

    def _route(self, ids: array[int] | None, body: dict[str, Any]
               ) -> tuple[bytes, int, tuple[tuple[str, int], ...]]:
        """``CountResult``'s block_hashes, block_size and prefix_hits of the prompt
        ``ids`` (b"", 0, () when the model is not prefix-routed or ``ids`` is None);
        the body's ``cache_salt`` goes in block 0 (checked either way)."""
        salt = _cache_salt(body)
        if self.router is None or ids is None:
            return b"", 0, ()
        blob, hits = self.router.route(ids, salt)
        return blob, self.router.block_size, hits

    # -- Anthropic Messages --------------------------------------------------------------

    def _count_messages(self, body: dict[str, Any], *, count_tokens: bool) -> CountResult:
        """A Messages body: converted as vLLM converts it (``apis.anthropic_messages``),
        then counted by the chat path. A count_tokens body generates nothing
        (max_tokens 0); a /v1/messages body's required max_tokens is checked like
        chat's."""
        if self.template is None:
            raise BadRequest("messages", f"model {self.model.name} has no chat template")
        chat = anthropic_messages.to_chat(body, self._messages_policy(),
                                          count_tokens=count_tokens)
        prompt_tokens, breakdown, ids = self._count_chat(chat.body, routed=not count_tokens)
        limit = self.model.max_model_len
        requested = chat.max_tokens
        if requested is None:
            return CountResult(prompt_tokens, limit, 0, 0, breakdown)
        if requested > limit:
            raise BadRequest("max_tokens", f"{requested} is greater than max_model_len {limit}")
        return CountResult(prompt_tokens, limit, min(requested, max(0, limit - prompt_tokens)),
                           requested, breakdown, 1, *self._route(ids, body))

    # -- OpenAI Responses ----------------------------------------------------------------

    def _count_responses(self, body: dict[str, Any]) -> CountResult:
        """A Responses body: converted as vLLM's Responses serving converts it
        (``apis.openai_responses``), then counted by the chat path; its
        ``max_output_tokens`` is checked and reserved like chat's ``max_tokens``."""
        if self.template is None:
            raise BadRequest("input", f"model {self.model.name} has no chat template")
        chat = openai_responses.to_chat(body)
        prompt_tokens, breakdown, ids = self._count_chat(chat.body)
        limit = self.model.max_model_len
        requested = chat.max_output_tokens
        if requested is not None and requested > limit:
            raise BadRequest("max_output_tokens", f"{requested} is greater than max_model_len "
                                                  f"{limit}")
        room = max(0, limit - prompt_tokens)
        effective = room if requested is None else min(requested, room)
        return CountResult(prompt_tokens, limit, effective, requested or 0, breakdown, 1,
                           *self._route(ids, body))

    def _messages_policy(self) -> anthropic_messages.TemplatePolicy:
        """What vLLM's Messages serving derives from this model's template at its
        start, worked out on the first Messages body (a few renders) and kept."""
        policy = self._messages_template_policy
        if policy is None:
            template = self.template
            assert template is not None

            def render(effort: str) -> str | None:
                try:
                    kwargs = self._template_kwargs({"reasoning_effort": effort})
                    return template.render([{"role": "user", "content": "Hi"}], None, kwargs)
                except (BadRequest, TemplateError):
                    return None
            policy = self._messages_template_policy = anthropic_messages.TemplatePolicy(
                merge_inline_system=anthropic_messages.requires_system_first(template.source),
                disabled_thinking_effort=anthropic_messages.disabled_thinking_effort(render),
                content_format=template.content_format)
        return policy

    # -- completions and embeddings ------------------------------------------------------

    def _count_completions(self, body: dict[str, Any]) -> tuple[int, int, int]:
        """(total prompt tokens, number of prompts, biggest prompt) of a completions body."""
        if "prompt" not in body or body["prompt"] is None:
            raise BadRequest("prompt", "required")
        if body.get("suffix") is not None:
            # vLLM 0.32 renders a suffix only for models with fill-in-the-middle
            # rendering (renderers/deepseek_v4.py), which the counter does not mirror;
            # it refuses it for the others, after admission (a non-string: pydantic's dump)
            raise BadRequest("suffix", "not supported: the prompt with a suffix "
                                       "(fill-in-the-middle) cannot be counted")
        counts = self._prompt_counts(body["prompt"], "prompt",
                                     opt_bool(body, "add_special_tokens", True))
        if 0 in counts:
            # vLLM: "The decoder prompt cannot be empty", after admission
            where = "prompt" if len(counts) == 1 else f"prompt[{counts.index(0)}]"
            raise BadRequest(where, "empty: a prompt needs at least one token")
        return sum(counts), len(counts), max(counts)

    def _first_prompt_ids(self, prompt: Any, add_special: bool) -> array[int]:
        """The token ids of the first prompt of a completions ``prompt`` already counted
        (so well-formed): a string's ``encode(text, add_special_tokens=add_special)``,
        an id list as given."""
        first = prompt if isinstance(prompt, str) or not isinstance(prompt[0], (str, list)) \
            else prompt[0]
        if not isinstance(first, str):
            return array("I", first)
        tok = self.tokenizer
        if add_special and tok.added_by_post_processor:
            assert tok.hf is not None
            return array("I", tok.hf.encode(first, add_special_tokens=True).ids)
        # counted before: its lookups are tallied there
        return tok.ids(tok.split(first), tally=False)[0]

    def _prompt_counts(self, prompt: Any, param: str, add_special: bool,
                       lower: bool = False) -> list[int]:
        """Tokens of each prompt of a completions ``prompt`` or an embeddings ``input``
        (``param`` names the field): a string, an array of strings, an array of token
        ids or an array of token-id arrays (vllm/renderers/inputs/preprocess.py
        ``prompt_to_seq``: a string or one id list is one prompt). A string counts
        ``encode(text, add_special_tokens=add_special)``'s ids (the post-processor's
        specials only when ``add_special``; Qwen adds none), lower-cased first with
        ``lower``; an id list its ids, each in the vocabulary. Raises ``BadRequest``."""
        tok = self.tokenizer
        specials = tok.added_by_post_processor if add_special else 0
        if isinstance(prompt, str):
            return [tok.count(prompt.lower() if lower else prompt) + specials]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(param, "expected a string, an array of strings, "
                                    "or an array of token ids (non-empty)")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            self._check_ids(prompt, param)
            return [len(prompt)]
        counts: list[int] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                counts.append(tok.count(p.lower() if lower else p) + specials)
            elif isinstance(p, list) and p and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in p):
                self._check_ids(p, f"{param}[{i}]")
                counts.append(len(p))
            else:
                raise BadRequest(f"{param}[{i}]", "expected a string or a non-empty array of "
                                                  "token ids")
        return counts

    def _count_embeddings(self, body: dict[str, Any]) -> CountResult:
        """An embeddings body (``apis.openai_embeddings``: ``input``'s prompts, counted
        as completions prompts are, lower-cased first for the encoders that say so);
        nothing is generated (max_tokens 0). Raises ``BadRequest``."""
        limit = self.model.max_model_len
        e = openai_embeddings.count(
            body, limit,
            lambda prompt, param, special: self._prompt_counts(prompt, param, special,
                                                               lower=self.lower_case))
        return CountResult(e.prompt_tokens, limit, 0, 0, Breakdown(messages=e.prompt_tokens),
                           e.prompt_count)

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        for j, x in enumerate(ids):
            if x < 0 or x >= vocab:
                raise BadRequest(f"{param}[{j}]", f"token id {x} is out of vocabulary "
                                                  f"(0..{vocab - 1})")

    # -- chat ----------------------------------------------------------------------------

    def _count_chat(self, body: dict[str, Any], routed: bool = True
                    ) -> tuple[int, Breakdown, array[int] | None]:
        """(prompt tokens, breakdown, the prompt's token ids when the model is
        prefix-routed and ``routed``, else None) of a chat body."""
        if self.template is None:
            raise BadRequest("messages", f"model {self.model.name} has no chat template")
        template = self.template
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", "expected a non-empty array of messages")
        if body.get("chat_template") is not None:
            raise BadRequest("chat_template", "request-provided chat templates are not allowed")
        conversation = [self._message(i, m) for i, m in enumerate(messages)]
        _postprocess_tool_calls(conversation)
        if any(m["role"] == "developer" for m in conversation) \
                and not template.supports_developer_role:
            conversation = _consolidate_system(
                [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                 if m["role"] == "developer" else m for m in conversation])
        tools = self._tools(body)
        kwargs = self._template_kwargs(body)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            rendered = template.prompt(conversation, kwargs.pop("tools", None), kwargs)
        except TemplateError as e:
            raise BadRequest("messages", f"chat template rejected the request: {e}") from e
        tok = self.tokenizer
        want_ids = routed and self.router is not None
        by_plan = segment_plan.cut(rendered, tok)
        # When the ids are needed (prefix routing), the pieces' counts are their lengths,
        # in one pass over the cached ids (PromptTokenizer.ids, keep_ids).
        ids: array[int] | None = None
        if by_plan is not None:
            plan, texts = by_plan
            # the prompt cut at its added tokens, as split() gives it
            pieces = [""] * (2 * len(texts) - 1)
            pieces[0::2], pieces[1::2] = texts, plan.specials
            if want_ids:
                ids, counts = tok.ids(pieces)
                text_counts = counts[0::2]
            else:
                text_counts = tok.text_counts(texts)
            total = sum(text_counts) + len(plan.specials)
            assert rendered.contents is not None
            inside = plan.content_tokens(rendered.contents, texts, text_counts)
            if inside is not None:
                system = sum(n for m, n in zip(conversation, inside, strict=True)
                             if m["role"] == "system")
                return total, _fit_parts(total, system, 0, sum(inside) - system), ids
            # the search below, on the pieces and their counts
            counts = [1] * len(pieces)
            counts[0::2] = text_counts
        else:
            pieces = tok.split(rendered.text)
            if want_ids:
                ids, counts = tok.ids(pieces)
            else:
                counts = tok.piece_counts(pieces)
            total = sum(counts)
        system = content = 0
        cursor = 0  # templates render messages in order: search forward only
        for m in conversation:
            c = m.get("content")
            if isinstance(c, str) and c:
                n, cursor = _tokens_inside(tok, pieces, counts, c, cursor)
                if m["role"] == "system":
                    system += n
                else:
                    content += n
        tool_tokens = 0
        cursor = 0
        for t in tools or []:
            n, cursor = _tokens_inside(tok, pieces, counts, json.dumps(t, ensure_ascii=False),
                                       cursor)
            tool_tokens += n
        return total, _fit_parts(total, system, tool_tokens, content), ids

    def _message(self, i: int, m: Any) -> dict[str, Any]:
        """vLLM's ConversationMessage for ``messages[i]``."""
        if type(m) is dict and len(m) == 2 and self._string_content:
            # the common message, {"role": ..., "content": "..."}: what the checks below
            # give it, without them
            role, content = m.get("role"), m.get("content")
            if type(content) is str and type(role) is str and role in _PLAIN_ROLES and not (
                    role == "system" and content.startswith(_CLAUDE_BILLING_HEADER)):
                return {"role": role, "content": content}
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(where, f"expected an object, got {type_name(m)}")
        role = expect_name(f"{where}.role", m.get("role"), ROLES, "role")
        content = m.get("content")
        if content is None and role != "assistant" and "content" in m:
            # vLLM 0.32 refuses it (a pydantic dump of 18-19 errors): only an assistant
            # message's content may be null (left out, it is empty)
            raise BadRequest(f"{where}.content", "expected a string or an array of content "
                                                 "parts, got null (only an assistant "
                                                 "message's content may be null)")
        if "name" in m and not isinstance(m["name"], str):
            raise BadRequest(f"{where}.name", f"expected a string, got {type_name(m['name'])}")
        texts = self._content_texts(where, role, content)
        out: dict[str, Any] = {"role": role}
        if self.template is not None and self.template.content_format == "openai":
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            # vLLM keeps only the parts that parse to a non-empty string
            # (renderers/chat_utils.py _parse_chat_message_content_parts: `if parse_res`)
            out["content"] = "\n".join(t for t in texts if t)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise BadRequest(f"{where}.tool_calls", "expected an array")
                out["tool_calls"] = [self._tool_call(f"{where}.tool_calls[{j}]", c)
                                     for j, c in enumerate(calls)]
            field = "reasoning"
            if m.get(field) is None:
                # vLLM 0.32 reads the deprecated reasoning_content as reasoning when that
                # is absent (ChatCompletionRequest's before-validator,
                # chat_completion/protocol.py)
                field = "reasoning_content"
            reasoning = m.get(field)
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise BadRequest(f"{where}.{field}", "expected a string")
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool":
            if isinstance(out["content"], list):  # vLLM joins tool text parts
                out["content"] = "\n".join(texts)
            if "tool_call_id" in m:
                if m["tool_call_id"] is not None and not isinstance(m["tool_call_id"], str):
                    raise BadRequest(f"{where}.tool_call_id", "expected a string")
                out["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
        if role == "developer":
            out["tools"] = m.get("tools")
        return out

    def _content_texts(self, where: str, role: str, content: Any) -> list[str]:
        param = f"{where}.content"
        if content is None:
            return []
        if isinstance(content, str):
            parts: list[Any] = [content]
        elif isinstance(content, list):
            parts = content
        else:
            raise BadRequest(param, f"expected a string or an array of content parts, got "
                                    f"{type_name(content)}")
        texts: list[str] = []
        for j, part in enumerate(parts):
            if isinstance(part, str):
                texts.append(part)
                continue
            pwhere = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise BadRequest(pwhere, f"expected an object, got {type_name(part)}")
            ptype = part.get("type")
            if not isinstance(ptype, str):
                raise BadRequest(f"{pwhere}.type", "required string")
            field = TEXT_PART_FIELDS.get(ptype)
            if field is None:
                raise BadRequest(f"{pwhere}.type", f"content part type {ptype!r} is not "
                                                   "supported: this model reads text only")
            text = part.get(field)
            if text is None:
                # vLLM 0.32's request model requires it (its parser would skip the part,
                # but the part's type check refuses it first: measured, 400)
                raise BadRequest(f"{pwhere}.{field}", f"required string for {ptype!r} parts")
            if not isinstance(text, str):
                raise BadRequest(f"{pwhere}.{field}", f"expected a string, got "
                                                      f"{type_name(text)}")
            texts.append(text)
        if role == "system":  # vLLM ``_strip_claude_code_billing_header``
            kept = []
            for t in texts:
                if t.startswith(_CLAUDE_BILLING_HEADER):
                    t = t.partition("\n")[2]
                    if not t:
                        continue
                kept.append(t)
            texts = kept
        return texts

    def _tool_call(self, where: str, c: Any) -> dict[str, Any]:
        """An assistant message's tool call as vLLM 0.32 takes it: openai's
        ``ChatCompletionMessageFunctionToolCallParam``, whose ``id``, ``type``
        ("function"), ``function.name`` and ``function.arguments`` (the arguments as
        JSON text, not an object) are required strings; vLLM refuses anything else with
        a pydantic dump of every message type it tried (measured)."""
        if not isinstance(c, dict):
            raise BadRequest(where, "assistant tool_calls entries must be objects")
        fn = c.get("function")
        if c.get("type") is None:
            raise BadRequest(f"{where}.type", "required string ('function')")
        if c["type"] != "function" or not isinstance(fn, dict):
            raise BadRequest(where, "only tool_calls of type 'function' with a function "
                                    "object are supported")
        if not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.function.name", "required string")
        _required_str(fn, "arguments", f"{where}.function",
                      " (the arguments as JSON text)")
        _required_str(c, "id", where, "")
        return {**c, "function": dict(fn)}

    def _tools(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Tool definitions as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them."""
        tools = body.get("tools")
        if tools is None:
            return None
        if not isinstance(tools, list):
            raise BadRequest("tools", "expected an array of tools")
        out = []
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict):
                raise BadRequest(where, "expected an object")
            if t.get("type", "function") != "function":
                raise BadRequest(f"{where}.type", "only 'function' tools are supported")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise BadRequest(f"{where}.function", "required object")
            if not isinstance(fn.get("name"), str):
                raise BadRequest(f"{where}.function.name", "required string")
            desc = fn.get("description")
            if desc is not None and not isinstance(desc, str):
                raise BadRequest(f"{where}.function.description", "expected a string")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise BadRequest(f"{where}.function.parameters", "expected an object")
            strict = fn.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise BadRequest(f"{where}.function.strict", "expected a boolean")
            dumped: dict[str, Any] = {"name": fn["name"], "description": desc,
                                      "parameters": params}
            if strict is not None:
                dumped["strict"] = strict
            defer = fn.get("defer_loading", t.get("defer_loading"))
            if defer is not None:
                dumped["defer_loading"] = defer
            tool: dict[str, Any] = {"type": "function", "function": dumped}
            if t.get("defer_loading") is not None:
                tool["defer_loading"] = t["defer_loading"]
            out.append(tool)
        return out

    def _template_kwargs(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``build_chat_params`` merge, filtered by ``resolve_chat_template_kwargs``."""
        assert self.template is not None
        user = body.get("chat_template_kwargs")
        if user is None:
            user = {}
        if not isinstance(user, dict):
            raise BadRequest("chat_template_kwargs", "expected an object")
        for k in user:
            if k in RESERVED_TEMPLATE_KWARGS:
                raise BadRequest(f"chat_template_kwargs.{k}", "not allowed")
            # vLLM merges every key into the template's arguments, where one such as
            # "tools" replaces what the request's checked fields set
            if k not in self.template_kwargs_allowed:
                allowed = ", ".join(sorted(self.template_kwargs_allowed)) or "none"
                raise BadRequest(f"chat_template_kwargs.{k}",
                                 f"not an allowed chat template argument (allowed: {allowed})")
        add_gen = opt_bool(body, "add_generation_prompt", True)
        cont = opt_bool(body, "continue_final_message", False)
        if add_gen and cont:
            raise BadRequest("continue_final_message", "cannot set both "
                             "continue_final_message and add_generation_prompt to true")
        effort = opt_choice(body, "reasoning_effort", REASONING_EFFORTS)
        documents = body.get("documents")
        if documents is not None and not (isinstance(documents, list) and all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                for d in documents)):
            # vLLM: list[dict[str, str]], refused after admission with pydantic's dump
            raise BadRequest("documents", "expected an array of objects whose values are "
                             "strings")
        extra: dict[str, Any] = {"add_generation_prompt": add_gen,
                                 "continue_final_message": cont,
                                 "documents": documents,
                                 "reasoning_effort": effort}
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
        merged = {**user, **{k: v for k, v in extra.items()
                             if v is not None and not (isinstance(v, str) and v == "auto")}}
        return {k: v for k, v in merged.items() if self.template.accepts(k)}


def _tokens_inside(tok: PromptTokenizer, pieces: list[str], counts: list[int], text: str,
                   start: int) -> tuple[int, int]:
    """(tokens that ``text`` contributes to the prompt cut into ``pieces``, next start).

    ``counts``: ``tok.piece_counts(pieces)``. Searches the text pieces (even indexes)
    from ``start`` on. In a chat template a message's content usually ends its piece
    (``"user\n" + content`` before ``<|im_end|>``), so a piece that ends with ``text``
    is preferred; the tokens are ``count(piece) - count(piece without text)``: the
    piece's count is known from the total and the rest is a short role header (a
    prefix of the piece: no added token in it, one cached lookup), so content is not
    tokenized twice. When no piece holds ``text`` (content with literal special
    tokens, or a template that reorders), ``text`` is counted on its own and ``start``
    stays. Never negative; exact up to BPE merges across the content boundary.
    """
    first = start + (start % 2)
    for k in range(first, len(pieces), 2):
        piece = pieces[k]
        if piece.endswith(text):
            rest = tok.count_piece(piece[:len(piece) - len(text)])
        else:
            at = piece.rfind(text)
            if at < 0:
                continue
            # the two sides joined may form an added token: split again
            rest = tok.count(piece[:at] + piece[at + len(text):])
        return max(0, counts[k] - rest), k + 2
    return tok.count(text), start


def _fit_parts(total: int, system: int, tools: int, messages: int) -> Breakdown:
    """The breakdown of a prompt of ``total`` tokens whose system, tool and message
    contents were found to hold these many; scaled down when they add up to more
    (content the template dropped, e.g. an unknown role)."""
    parts = system + tools + messages
    if parts > total:
        system, tools, messages = (x * total // parts for x in (system, tools, messages))
    return Breakdown(system, tools, messages, total - system - tools - messages)


def _fit(b: Breakdown, total: int) -> Breakdown:
    """Scale a breakdown down to ``total`` tokens (after truncation), keeping the sum exact."""
    parts = b.system + b.tools + b.messages + b.template_overhead
    if parts <= total or parts == 0:
        return b
    system, tools, messages = (x * total // parts for x in (b.system, b.tools, b.messages))
    return Breakdown(system, tools, messages, total - system - tools - messages)


def _postprocess_tool_calls(conversation: list[dict[str, Any]]) -> None:
    """vLLM ``_postprocess_messages``: tool-call arguments become dicts for the template."""
    for m in conversation:
        if m["role"] != "assistant" or "tool_calls" not in m:
            continue
        if not m["tool_calls"]:
            del m["tool_calls"]
            continue
        for call in m["tool_calls"]:
            fn = call["function"]
            args = fn.get("arguments")
            if not args:
                fn["arguments"] = {}
            elif isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = None
                fn["arguments"] = parsed if isinstance(parsed, dict) else {}


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM ``_consolidate_system_messages``: all system messages merged at position 0."""
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    needed = False
    for i, m in enumerate(conversation):
        if m["role"] == "system":
            if i > 0 or contents:
                needed = True
            c = m.get("content", "")
            if isinstance(c, list):
                c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c
                              if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
            if c:
                contents.append(c)
        else:
            rest.append(m)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]
