"""OpenAI embeddings bodies (``POST /v1/embeddings``, a pooling model): their prompt
tokens as vLLM 0.32 counts them.

``input`` takes the completions prompt's four shapes and each prompt is counted the
same way (vllm/entrypoints/pooling/base/io_processor.py ``get_request_factory_online``:
one engine request per prompt, ``prompt_to_seq``); then vLLM's pooling
``TokenizeParams`` (vllm/entrypoints/pooling/base/protocol.py
``EmbeddingTokenizeParamsMixin``, vllm/renderers/params.py): the text lower-cased
first when the model's sentence-transformers configuration says ``do_lower_case``,
``truncate_prompt_tokens`` keeps at most that many tokens of each prompt (-1:
``max_model_len``, no token held back for output), ``padding: "max_length"`` pads each
to ``max_model_len``, and a prompt still longer than ``max_model_len`` is refused
(``ContextLengthExceeded``). vLLM reports the sum as ``usage.prompt_tokens``
(vllm/entrypoints/pooling/utils.py ``get_pooling_usage``). The chat-shaped inputs
vLLM's embeddings also take (``messages``, ``input`` as messages) are not counted here:
the edge refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokengate.counter.errors import BadRequest, ContextLengthExceeded
from tokengate.counter.fields import opt_bool, opt_choice, opt_int

# prompt_counts(prompt, param, add_special) -> tokens of each prompt of a completions
# ``prompt`` or an embeddings ``input`` (``ModelCounter``'s reading of the four shapes,
# with the model's lower-casing)
PromptCounts = Callable[[Any, str, bool], list[int]]


@dataclass(frozen=True)
class Embeddings:
    """An embeddings body's count: ``prompt_tokens`` (the sum over its prompts, vLLM's
    ``usage.prompt_tokens``) and ``prompt_count`` (its prompts); nothing is generated."""

    prompt_tokens: int
    prompt_count: int


def count(body: dict[str, Any], max_model_len: int, prompt_counts: PromptCounts) -> Embeddings:
    """Each prompt of ``body["input"]`` after vLLM's pooling ``TokenizeParams``
    (vllm/renderers/params.py, with ``max_total_tokens = max_model_len`` and
    ``max_output_tokens = 0``, vllm/entrypoints/pooling/base/protocol.py):

    - ``truncate_prompt_tokens`` t (>= -1; above ``max_model_len`` refused, as vLLM's
      ``_validate_request`` does): at most t tokens of each prompt kept (-1:
      ``max_model_len``, nothing held back for output; ``truncation_side`` picks which
      end, the count is the same);
    - ``padding: "max_length"``: each prompt padded with the pad token to
      ``max_model_len`` (vLLM counts the pad tokens as prompt tokens);
    - a prompt still above ``max_model_len`` tokens: ``ContextLengthExceeded`` naming it
      (vLLM's ``_token_len_check``; ``input`` for one prompt, ``input[i]`` in a list); an
      empty one (``""``, or truncated to 0 tokens): ``BadRequest`` (vLLM: "The decoder
      prompt cannot be empty").

    ``prompt_counts`` counts the prompts (tokens each). Raises ``BadRequest``."""
    prompt = body.get("input")
    if prompt is None:
        raise BadRequest("input", "required")
    limit = max_model_len
    truncate = opt_int(body, "truncate_prompt_tokens", -1)
    if truncate is not None and truncate > limit:
        raise BadRequest("truncate_prompt_tokens", f"{truncate} is greater than "
                                                   f"max_model_len {limit}")
    keep = limit if truncate == -1 else truncate
    opt_choice(body, "truncation_side", ("left", "right"))
    pad = opt_choice(body, "padding", ("max_length", "do_not_pad")) == "max_length"
    counts = prompt_counts(prompt, "input", opt_bool(body, "add_special_tokens", True))
    # one prompt (a string, or one list of ids) is named "input", a list's "input[i]"
    one = isinstance(prompt, str) or not isinstance(prompt[0], (str, list))
    for i, n in enumerate(counts):
        if keep is not None and n > keep:
            n = counts[i] = keep
        if pad and n < limit:
            n = counts[i] = limit
        if n == 0:
            # vLLM: "The decoder prompt cannot be empty" (400)
            raise BadRequest("input" if one else f"input[{i}]",
                             "empty prompt" + (" after truncate_prompt_tokens"
                                               if keep == 0 else ""))
        if n > limit:
            raise ContextLengthExceeded(
                "input" if one else f"input[{i}]",
                f"This model's maximum context length is {limit} tokens. However, "
                f"your input contains {n} tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input.")
    return Embeddings(sum(counts), len(counts))
