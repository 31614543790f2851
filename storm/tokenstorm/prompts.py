"""Prompts of an exact number of prompt tokens, built with the served model's tokenizer.

A load test that asks for "2000 input tokens" must send requests that the server counts
as 2000 prompt tokens, or every tokens/s figure is off by the template overhead and the
tokenizer's merges. TokenStorm builds prompt text from *words that are exactly one
token*: lowercase ASCII words ``w`` for which both ``w`` and ``" w"`` are single entries
of the model's ``tokenizer.json`` vocabulary. Byte-level BPE tokenizers with GPT-style
pre-tokenization (Qwen, Llama 3, GPT-4o) split ``" w1 w2 w3"`` into the pre-tokens
``" w1"``, ``" w2"``, ``" w3"``, each of which is then one token, so a text of k such
words is exactly k tokens. The builder verifies that on a sample with HF
``tokenizers`` at start (``PromptError`` if not), and the load generator compares each
request's expected count with the ``usage.prompt_tokens`` the server reports.

Chat requests add the chat template's overhead: the template is rendered the way vLLM
renders it (``apply_chat_template(messages, add_generation_prompt=True)``, tokenized
with ``add_special_tokens=False``) for a one-message conversation and
the overhead (tokens) is measured once; for Qwen3's ChatML it is 8 tokens
(``<|im_start|>user\\n`` ... ``<|im_end|>\\n<|im_start|>assistant\\n``). Completions
prompts add the tokenizer's special tokens (none for Qwen).

Every prompt starts with two words that encode its request index, so no two prompts
share a prefix beyond chance (no prefix-cache hits, no counter segment-cache hits);
the rest is a slice of a seeded random word corpus.

**Shared prefixes** (``Sharing``): agent and chat traffic resends long prefixes (a
tenant's system prompt and tool schemas, a conversation's history), which a server's
prefix cache (vLLM: ``vllm/v1/core/kv_cache_utils.py``) serves without prefill. With
``Sharing(tenants, prefix_tokens, conversations)`` each request belongs to one of
``tenants`` tenants and continues one of its ``conversations`` conversations, both drawn
uniformly from a hash of the request's index and the seed (``Sharing.place``); its prompt
is that tenant's system prompt (``prefix_tokens`` words, the same in every request of
the tenant; a chat ``system`` message, or the head of a completions prompt) followed by
the conversation's history: the first words of a word stream of its own per (tenant,
conversation), so successive turns of one conversation extend the same text and share
their common prefix. Lengths stay exactly the plan's: the history takes what the
overhead and the system prompt leave. (Drawn, not ``index % tenants``: in index order,
round-robin routing over a number of replicas that divides the tenants would send each
tenant to one replica, a prefix-aware router by accident.)
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {"chat": "/v1/chat/completions",
                                  "completions": "/v1/completions"}
_WORD = re.compile(r"[a-z]{3,9}")


class PromptError(ValueError):
    """The tokenizer does not allow exact prompts (message says why)."""


@dataclass(frozen=True)
class StreamOptions:
    """What the generated requests ask for besides the prompt.

    ``stream``: SSE; ``include_usage`` / ``continuous_usage_stats``: vLLM's
    ``stream_options`` (cumulative usage in every chunk, a final usage chunk);
    ``ignore_eos``: vLLM's extension that makes the output exactly ``max_tokens``
    long (benchmarks need fixed output lengths).
    """

    stream: bool = False
    include_usage: bool = True
    continuous_usage_stats: bool = True
    ignore_eos: bool = True


@dataclass(frozen=True)
class Sharing:
    """Which requests share prompt prefixes (see the module text).

    ``tenants``: how many tenants the requests are drawn from (``place``); 0: no
    sharing, every prompt starts with words of its own. ``prefix_tokens``: tokens of
    each tenant's system prompt (its words; the chat template's own tokens come on top).
    ``conversations``: conversations per tenant, each request continuing one of them.
    """

    tenants: int = 0
    prefix_tokens: int = 0
    conversations: int = 1

    def __post_init__(self) -> None:
        if self.tenants < 0 or self.prefix_tokens < 0 or self.conversations < 1:
            raise ValueError("sharing: tenants and prefix tokens must be >= 0, "
                             "conversations >= 1")
        if self.tenants == 0 and self.prefix_tokens > 0:
            raise ValueError("sharing: a shared prefix needs tenants (> 0) to share it")

    @property
    def enabled(self) -> bool:
        return self.tenants > 0

    def place(self, index: int, seed: int = 0) -> tuple[int, int]:
        """(tenant, conversation) of request ``index``: uniform draws from SplitMix64
        of (index, seed) (Steele et al., OOPSLA 2014), the same for the same seed. The
        conversation's number is unique across tenants (``tenant * conversations + c``,
        ``c < conversations``)."""
        h = _splitmix64(index ^ (seed << 40))
        tenant = h % self.tenants
        return tenant, tenant * self.conversations + (h // self.tenants) % self.conversations

    def describe(self) -> str:
        if not self.enabled:
            return "no shared prefixes"
        return (f"{self.tenants} tenants with {self.prefix_tokens}-token system prompts, "
                f"{self.conversations} conversation(s) each")


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a well-mixed 64-bit hash of ``x``."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _stream_start(key: int, n: int) -> int:
    """Where word stream ``key`` starts in a corpus of ``n`` words (Knuth's
    multiplicative hash: neighbouring keys start far apart)."""
    return (key * 2654435761 + 97) % n


class PromptBuilder:
    """Builds request bodies whose prompt is exactly ``n`` tokens for the served model.

    ``model_dir``: the served model's directory (``tokenizer.json``,
    ``tokenizer_config.json``); ``model``: served model name; ``endpoint``: ``chat``
    or ``completions``; ``seed``: corpus seed (same seed, same prompts); ``sharing``:
    which requests share prefixes (default: none).
    """

    def __init__(self, model_dir: Path, model: str, endpoint: Endpoint = "chat",
                 seed: int = 0, corpus_words: int = 1 << 17,
                 sharing: Sharing | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.model = model
        self.endpoint: Endpoint = endpoint
        self.path = ENDPOINT_PATHS[endpoint]
        self.sharing = sharing or Sharing()
        self.seed = seed
        self._tenant_text: dict[int, str] = {}
        path = (self.model_dir / "tokenizer.json").resolve()
        st = path.stat()
        self.tokenizer, self.words = _tokenizer_and_words(str(path), st.st_size, st.st_mtime_ns)
        if len(self.words) < 256:
            raise PromptError(f"{model_dir}: only {len(self.words)} single-token words")
        rng = random.Random(seed)
        corpus = [rng.choice(self.words) for _ in range(corpus_words)]
        self._corpus = " ".join(corpus)
        # Character offset of each corpus word (and one past the end).
        lengths = np.fromiter((len(w) + 1 for w in corpus), dtype=np.int64, count=len(corpus))
        self._offsets = np.concatenate(([0], np.cumsum(lengths))).tolist()
        self._verify_sample(rng)
        self.overhead = self._measure_overhead()
        self._model_json = json.dumps(model)

    # -- exactness ------------------------------------------------------------------

    def _verify_sample(self, rng: random.Random) -> None:
        start = rng.randrange(0, len(self._offsets) - 5001)
        text = self.content(12345, 5000, start=start)
        n = len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if n != 5000:
            raise PromptError(f"a 5000-word sample tokenizes to {n} tokens; this tokenizer "
                              "does not split words the way PromptBuilder assumes")

    def _measure_overhead(self) -> int:
        """Prompt tokens beyond the words' own: chat template or special tokens, for
        the shape of this builder's prompts (with a system prompt when sharing one)."""
        system = self.tenant_prompt(0) if self.sharing.prefix_tokens else None
        words = self.sharing.prefix_tokens
        overheads = set()
        for k in (1, 7, 300):
            text = self.content(k, k)
            overheads.add(self.count(text, system) - k - words)
        if len(overheads) != 1:
            raise PromptError(f"template overhead depends on the content length: {overheads}")
        return overheads.pop()

    def render_chat(self, content: str, system: str | None = None) -> str:
        """The prompt text vLLM renders for one user message (``add_generation_prompt``),
        after a system message when ``system`` is given."""
        from transformers.utils.chat_template_utils import render_jinja_template

        cfg = json.loads((self.model_dir / "tokenizer_config.json").read_text())
        source = cfg.get("chat_template")
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.exists():
            source = jinja_file.read_text()
        if not isinstance(source, str):
            raise PromptError(f"{self.model_dir}: no chat template")
        special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if isinstance(cfg.get(k), str)}
        # Returns (rendered conversations, generation indices).
        messages = [{"role": "user", "content": content}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        out: Any = render_jinja_template(
            conversations=[messages], tools=None,
            chat_template=source, add_generation_prompt=True, **special)
        return str(out[0][0])

    def count(self, content: str, system: str | None = None) -> int:
        """Prompt tokens of a request with this content (after the system prompt
        ``system`` when given), counted the way vLLM counts.

        Chat: the rendered template tokenized with ``add_special_tokens=False``;
        completions: the text (``system + " " + content``) tokenized with the
        tokenizer's special tokens.
        """
        if self.endpoint == "chat":
            return len(self.tokenizer.encode(self.render_chat(content, system),
                                             add_special_tokens=False).ids)
        text = content if system is None else system + " " + content
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    @property
    def min_prompt_tokens(self) -> int:
        """The shortest prompt (tokens) this builder can make: overhead + the shared
        system prompt + one word."""
        return self.overhead + self.sharing.prefix_tokens + 1

    # -- building ---------------------------------------------------------------------

    def content(self, index: int, words: int, start: int | None = None) -> str:
        """``words`` single-token words; the first two encode ``index`` (unique prefix)."""
        v = len(self.words)
        head = [self.words[(index // v) % v], self.words[index % v]][:words]
        rest = words - len(head)
        if rest <= 0:
            return " ".join(head)
        n_corpus = len(self._offsets) - 1
        if rest > n_corpus:
            raise PromptError(f"prompt of {words} words exceeds the corpus ({n_corpus})")
        if start is None:
            start = (index * 7919) % (n_corpus - rest + 1)
        body = self._corpus[self._offsets[start]:self._offsets[start + rest] - 1]
        return " ".join(head) + " " + body

    def _stream(self, key: int, words: int) -> str:
        """``words`` words of word stream ``key``: two words that encode ``key`` (the
        low digit first: streams differ from their first word), then the corpus from
        the stream's own start on (wrapping around at its end), so a stream's text for
        n words is the start of its text for n + 1."""
        v = len(self.words)
        head = [self.words[key % v], self.words[(key // v) % v]][:words]
        rest = words - len(head)
        n_corpus = len(self._offsets) - 1
        if rest > n_corpus:
            raise PromptError(f"a text of {words} words exceeds the corpus ({n_corpus})")
        parts = [" ".join(head)]
        start = _stream_start(key, n_corpus)
        while rest > 0:
            take = min(rest, n_corpus - start)
            parts.append(self._corpus[self._offsets[start]:self._offsets[start + take] - 1])
            rest -= take
            start = 0
        return " ".join(parts)

    def tenant_prompt(self, tenant: int) -> str:
        """Tenant ``tenant``'s system prompt: ``sharing.prefix_tokens`` single-token
        words (two encode the tenant), the same text in every request of the tenant."""
        text = self._tenant_text.get(tenant)
        if text is None:
            # streams of tenants and of conversations never start at the same word
            text = self._stream(2 * tenant, self.sharing.prefix_tokens)
            self._tenant_text[tenant] = text
        return text

    def parts(self, index: int, prompt_tokens: int) -> tuple[str | None, str]:
        """(system prompt or None, user content) of request ``index`` with exactly
        ``prompt_tokens`` prompt tokens. Without sharing: no system prompt, ``content``'s
        unique words. With sharing: the tenant's system prompt (when ``prefix_tokens``)
        and the first words of the request's conversation. Raises ``PromptError`` when
        ``prompt_tokens < min_prompt_tokens``."""
        words = prompt_tokens - self.overhead - self.sharing.prefix_tokens
        if words < 1:
            raise PromptError(f"{prompt_tokens} prompt tokens is below the minimum "
                              f"{self.min_prompt_tokens} for {self.endpoint}"
                              + (f" with a {self.sharing.prefix_tokens}-token shared prefix"
                                 if self.sharing.prefix_tokens else ""))
        if not self.sharing.enabled:
            return None, self.content(index, words)
        tenant, conversation = self.sharing.place(index, self.seed)
        system = self.tenant_prompt(tenant) if self.sharing.prefix_tokens else None
        return system, self._stream(2 * conversation + 1, words)

    def body(self, index: int, prompt_tokens: int, max_tokens: int,
             opts: StreamOptions) -> bytes:
        """A JSON request body whose prompt is exactly ``prompt_tokens`` tokens
        (request ``index``'s words: ``parts``).

        Raises ``PromptError`` when ``prompt_tokens < min_prompt_tokens``.
        """
        system, text = self.parts(index, prompt_tokens)
        if self.endpoint == "chat":
            head = '{"model":' + self._model_json + ',"messages":['
            if system is not None:
                head += '{"role":"system","content":"' + system + '"},'
            head += '{"role":"user","content":"' + text + '"}]'
        else:
            if system is not None:
                text = system + " " + text
            head = '{"model":' + self._model_json + ',"prompt":"' + text + '"'
        tail = ',"max_tokens":' + str(max_tokens)
        if opts.ignore_eos:
            tail += ',"ignore_eos":true'
        if opts.stream:
            tail += (',"stream":true,"stream_options":{"include_usage":'
                     + ("true" if opts.include_usage else "false")
                     + ',"continuous_usage_stats":'
                     + ("true" if opts.continuous_usage_stats else "false") + "}")
        return (head + tail + "}").encode()


@functools.lru_cache(maxsize=4)
def _tokenizer_and_words(path: str, size: int, mtime_ns: int
                         ) -> tuple[Tokenizer, list[str]]:
    """tokenizer.json at ``path`` and its ``single_token_words``, read once per file
    version (``size``, ``mtime_ns``) in a process: builders of the same model (a test
    session makes dozens, ~1 s each) share the read-only tokenizer."""
    tokenizer = Tokenizer.from_file(path)
    return tokenizer, single_token_words(tokenizer)


def single_token_words(tokenizer: Tokenizer) -> list[str]:
    """Lowercase ASCII words ``w`` (3-9 letters) with ``w`` and ``" w"`` one token each.

    Byte-level BPE vocabularies spell a leading space as ``Ġ``; sorted for determinism.
    """
    vocab = tokenizer.get_vocab()
    words = []
    for tok in vocab:
        if tok.startswith("\u0120") and _WORD.fullmatch(tok[1:]) and tok[1:] in vocab:
            words.append(tok[1:])
    return sorted(words)


def expected_counts(builder: PromptBuilder, sizes: Sequence[int]) -> list[int]:
    """HF-tokenizer counts of the prompts ``body`` builds for ``sizes`` (for tests)."""
    out = []
    for i, n in enumerate(sizes):
        system, content = builder.parts(i, n)
        out.append(builder.count(content, system))
    return out
