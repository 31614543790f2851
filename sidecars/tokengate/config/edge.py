"""The sections of the nginx edge: ``edge`` (listeners, body and JSON bounds, the
counter call, special tokens, structured-output bounds, replicas' health, global-limit
calls, failed keys, CORS, KV-cache-aware admission) and ``access_log`` (its sampled
access log). ``tokengate.tools.compile_config`` compiles them to JSON for nginx."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from tokengate.config.types import (
    MAX_COUNT,
    Count,
    Finite,
    HostPort,
    LoopbackHostPort,
    Network,
    NonEmpty,
    OptionalPath,
    Origin,
    Positive,
    Rate,
    RelPath,
    Role,
    _check,
    _Schema,
)

# the counter's gRPC server refuses larger messages (grpc.max_receive_message_length)
COUNTER_MAX_MESSAGE_BYTES = 64 << 20


class AccessLogConfig(_Schema):
    """Tiered access-log sampling (usage events are never sampled)."""

    error_status: int = Field(
        default=400, ge=100, le=999,
        description="Status >= this: always logged.")
    slow_ms: Finite = Field(
        default=5000.0,
        description="Total time above this, ms: logged at slow_rate.")
    slow_rate: Rate = Field(
        default=0.1,
        description="Fraction of the slow requests logged (0..1).")
    rate: Rate = Field(
        default=0.01,
        description="Fraction of every other request logged (0..1).")
    file: OptionalPath = Field(
        default=Path("var/log/access.sampled.log"), validate_default=True,
        description="Where the edge writes the sampled lines, one JSON line each; false or "
                    "\"\": off.")


class StructuredOutputLimits(_Schema):
    """Bounds on the structured-output inputs of a request (``edge.structured_output``).

    vLLM compiles a schema, regex or grammar into a token mask before it generates, and
    that work grows with the constraint, not with the prompt: a 57 KB ``response_format``
    schema of 2,000 properties took vLLM 92 s on a CPU server and was billed 13 tokens.
    Bounded fields: ``response_format`` and ``structured_outputs`` (vLLM 0.32's
    ``ChatCompletionRequest`` / ``CompletionRequest``), and the legacy ``guided_json``,
    ``guided_regex``, ``guided_grammar``, ``guided_choice`` (ignored by vLLM 0.32, compiled
    by older servers). A string that holds a JSON schema (``structured_outputs.json``,
    ``structural_tag``) is measured as the schema it decodes to.
    """

    max_bytes: Positive = Field(
        default=65536,
        description="Largest JSON encoding of one structured-output field, bytes (400 above "
                    "it).")
    max_depth: Positive = Field(
        default=24,
        description="Deepest nesting of one structured-output field, JSON levels (objects "
                    "and arrays; a schema level is about two: `properties`, then the "
                    "property).")
    max_properties: Positive = Field(
        default=256,
        description="Most named properties in one structured-output field: the members of "
                    "every `properties` object in it, at any depth, added up.")


# Template variables that a request sets through fields the edge checks (messages, tools,
# documents) or that vLLM sets itself: allowing one in chat_template_kwargs would let a
# request replace checked content with unchecked content (vllm/renderers/hf.py merges
# chat_template_kwargs into the template's arguments).
TEMPLATE_KWARGS_NEVER_ALLOWED = frozenset({
    "messages", "conversation", "conversations", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
})


def _template_kwargs(names: list[str]) -> list[str]:
    bad = sorted(set(names) & TEMPLATE_KWARGS_NEVER_ALLOWED)
    if bad:
        raise ValueError(f"{', '.join(bad)} cannot be allowed: the request sets "
                         f"{'it' if len(bad) == 1 else 'them'} through checked fields, or "
                         "vLLM does")
    return names


class AuthFailuresConfig(_Schema):
    """Requests without a valid API key (``edge.auth_failures``).

    They write no usage event (the ledger bills authenticated requests only); the status
    listener counts them by reason and the sampled access log gets at most
    ``log_lines_per_s`` of them per second per nginx worker. A client that keeps
    presenting wrong keys is blocked: ``threshold`` invalid keys from one client within
    ``window_s`` (counted from its first failure) and every request from it is answered
    429 with ``Retry-After`` for ``block_s``, before its key is checked, so a valid key
    from a blocked client waits too (a blocked guesser learns nothing). A client is an
    IPv4 address or an IPv6 /64 (one host commonly holds a whole /64); nginx's
    ``$remote_addr``, so behind a proxy set nginx's real_ip module up or exempt the proxy.
    Requests without any key are counted and logged but never block.
    """

    threshold: Count = Field(
        default=100,
        description="Invalid API keys from one client within window_s that block it; 0: "
                    "never block.")
    window_s: Positive = Field(
        default=60,
        description="How long a client's failures are counted, from its first one, s.")
    block_s: Positive = Field(
        default=60,
        description="How long a blocked client is answered 429 (Retry-After), whatever "
                    "key it sends, s.")
    exempt: list[Network] = Field(
        default=[],
        description="Client networks never blocked (CIDR or address): a NAT gateway or "
                    "proxy that many clients share.")
    log_lines_per_s: Count = Field(
        default=10,
        description="Sampled access-log lines of requests without a valid key, at most, "
                    "per second and nginx worker (all are counted on the status listener).")


class CorsConfig(_Schema):
    """Browsers calling the API from web pages of other origins (``edge.cors``): the
    Fetch standard's CORS protocol (https://fetch.spec.whatwg.org/#http-cors-protocol).

    Off while ``allow_origins`` is empty: the edge then sends no CORS header, and a
    browser's preflight (OPTIONS with Origin and Access-Control-Request-Method) is
    answered 403. With origins listed, a preflight to an API path from one of them is
    answered 204 before any key is asked for (browsers send none on a preflight) with
    the path's methods, the request headers it asked for and ``max_age_s``; every answer
    to a request from one of them (errors and 429s included) carries
    ``Access-Control-Allow-Origin`` and exposes the x-ratelimit-*, x-budget-*,
    Retry-After, X-Request-Id and X-Token-Count headers to the page. The API key still
    decides everything else: a page holding a key can do what the key can.
    """

    allow_origins: list[Origin] = Field(
        default=[],
        description="Origins whose pages may call the API (`https://app.example.com`, "
                    "`http://localhost:3000`: scheme, host, optional port), or `*` for "
                    "any (then the only entry); empty: CORS off.")
    max_age_s: int = Field(
        default=600, ge=0, le=86400,
        description="How long a browser may cache a preflight's answer "
                    "(Access-Control-Max-Age), s.")

    @model_validator(mode="after")
    def _star_alone(self) -> CorsConfig:
        if "*" in self.allow_origins and len(self.allow_origins) > 1:
            _check([("allow_origins", "`*` already allows every origin: list it alone")])
        if len(set(self.allow_origins)) != len(self.allow_origins):
            _check([("allow_origins", "an origin is listed twice")])
        return self


class PriorityConfig(_Schema):
    """When replicas are too full for the keys of one priority
    (``edge.admission.priorities.<name>``): a lower priority has lower bounds, so its
    requests are shed first."""

    kv_cache_threshold: Rate = Field(
        default=0.92,
        description="A replica whose vllm:kv_cache_usage_perc (0..1) is above this takes "
                    "no new request of this priority (except small prompts, "
                    "small_prompt_headroom).")
    max_waiting: Count = Field(
        default=32,
        description="A replica whose vllm:num_requests_waiting is above this takes no new "
                    "request of this priority, requests.")
    max_running: Count | None = Field(
        default=None,
        description="A replica running this many requests (vllm:num_requests_running plus "
                    "vllm:num_requests_waiting as last read, moved by the requests this "
                    "edge started and ended there since, and never fewer than this edge "
                    "has in flight there) takes no new request of this priority, "
                    "requests; null: no bound. Below vLLM's --max-num-seqs it keeps seats "
                    "free for the priorities above (vLLM does not preempt a running "
                    "request for a seat).")
    max_prefill_tokens: Positive | None = Field(
        default=None,
        description="Paces this priority's prefills on each replica while requests of "
                    "other priorities run there: each request of it sent to a replica "
                    "takes that replica's prefill lane for prompt tokens / this x the "
                    "replica's mean TTFT (vllm:time_to_first_token_seconds), and the "
                    "next waits for the lane; so at most about this many of its prompt "
                    "tokens per TTFT, one request at a time, share the engine's steps "
                    "with the interactive requests' prefills, tokens; null: no bound. "
                    "About the GPU's ridge (256 on an H100: prefill tokens a decode step "
                    "absorbs at almost no cost).")
    vllm_priority: int = Field(
        default=0, ge=-1_000_000, le=1_000_000,
        description="The `priority` of this priority's requests on a model whose replicas "
                    "run vLLM's --scheduling-policy priority (models.<name>."
                    "scheduling_policy): vLLM admits waiting requests of a lower value "
                    "first and, when its KV cache runs short, preempts the running "
                    "request of the highest value. 0: vLLM's default.")
    hold_ms: Count = Field(
        default=0,
        description="How long a request of this priority that finds every replica full "
                    "(its bounds above) waits at the edge for room before it is shed, ms; "
                    "it holds no replica meanwhile and looks again every 2 ms. 0: shed "
                    "at once. Ignored with edge.queue.enabled (the queue holds it).")


def _default_priorities() -> dict[str, PriorityConfig]:
    return {"low": PriorityConfig(kv_cache_threshold=0.85, max_waiting=8,
                                  max_prefill_tokens=256, hold_ms=200, vllm_priority=1),
            "normal": PriorityConfig()}


class AdmissionConfig(_Schema):
    """KV-cache-aware admission (``edge.admission``).

    One nginx worker reads every replica's vLLM ``/metrics`` every
    ``metrics_interval_ms``: ``vllm:kv_cache_usage_perc`` (largest of its engines),
    ``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` (summed),
    ``vllm:request_success_total`` (its finish rate). For a request of a key whose
    priority is P, a replica is *full* when its KV-cache usage is above
    P's ``kv_cache_threshold`` (a prompt of at most ``small_prompt_tokens`` may go up to
    ``kv_cache_threshold + small_prompt_headroom``) or its waiting queue above P's
    ``max_waiting``; *unknown* when its metrics are older than ``metrics_stale_ms`` (it
    stopped answering them, or does not serve them); else it has *room*. A request goes to
    a replica with room, else to an unknown one; when every replica that is not out is
    full it is answered 503 ``overloaded`` before anything is reserved, with a
    ``Retry-After`` estimated from the queue.
    """

    metrics_interval_ms: Count = Field(
        default=1000,
        description="Every this many ms one nginx worker reads each replica's /metrics, ms. "
                    "0: off (every replica unknown: no request is shed).")
    metrics_timeout_ms: Positive = Field(
        default=500,
        description="How long each step of reading a replica's /metrics (connect, send, "
                    "each line of the answer) may wait, ms.")
    metrics_stale_ms: Positive = Field(
        default=3000,
        description="Metrics older than this are unknown, ms (a replica that stops answering "
                    "/metrics is unknown after this long); more than metrics_interval_ms.")
    priorities: dict[str, PriorityConfig] = Field(
        default_factory=_default_priorities, min_length=1,
        description="Bounds by priority name; each key has one (keys.<id>.priority, "
                    "default `normal`).")
    small_prompt_tokens: Count = Field(
        default=256,
        description="A prompt of at most this many tokens may still go to a replica above "
                    "its priority's kv_cache_threshold (a small prefill needs few KV-cache "
                    "blocks), tokens; 0: none may.")
    small_prompt_headroom: Rate = Field(
        default=0.03,
        description="How far above kv_cache_threshold a small prompt is still admitted "
                    "(0..1 of the KV cache). The max_waiting bound applies to it all the "
                    "same: it queues like any other request.")
    max_retry_after_s: Positive = Field(
        default=30,
        description="Largest Retry-After of a shed request, s; also the answer when no "
                    "replica is finishing requests.")

    @model_validator(mode="after")
    def _stale(self) -> AdmissionConfig:
        if self.metrics_interval_ms and self.metrics_stale_ms <= self.metrics_interval_ms:
            why = f"{self.metrics_stale_ms} must exceed metrics_interval_ms " \
                  f"({self.metrics_interval_ms})"
            _check([("metrics_stale_ms", why)])
        return self


class QueueConfig(_Schema):
    """Fair queueing (``edge.queue``): when no replica of a model can take a request now
    (every one is full for the key's priority, or at ``models.<name>.max_concurrency``),
    the edge holds it in its key's queue instead of answering 503, and dispatches the
    queued requests as replicas free up, in the order of the Virtual Token Counter
    (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): the key with
    the fewest weighted tokens served first; a key that becomes active again starts at
    the smallest counter of the keys waiting, so idling earns no credit. Priorities are
    served strictly (a priority with a higher kv_cache_threshold first); keys of one
    priority share by ``keys.<id>.fair_share``. Each edge orders its own queues (all of
    its nginx workers share them); several edges are each fair on their own share.
    """

    enabled: bool = Field(
        default=False,
        description="Hold requests that no replica can take now in per-key queues "
                    "instead of answering 503 overloaded.")
    max_wait_ms: Positive = Field(
        default=30_000,
        description="Longest a request waits in its queue, ms; then 503 queue_timeout "
                    "with Retry-After. A request may ask for less (X-Tokengate-Queue-"
                    "Timeout-Ms), never more.")
    max_requests: Positive = Field(
        default=1024,
        description="Most requests waiting in all queues of the edge together; one more "
                    "is answered 503 overloaded with Retry-After.")
    max_tokens: Positive = Field(
        default=4_000_000,
        description="Most tokens (prompt + reserved completion) waiting in all queues "
                    "together, tokens; beyond it 503 overloaded.")
    key_max_requests: Positive = Field(
        default=64,
        description="Most requests of one key waiting; one more is answered 429 "
                    "queue_full with Retry-After (the key's own share is taken).")
    key_max_tokens: Positive = Field(
        default=400_000,
        description="Most tokens of one key waiting, tokens; beyond it 429 queue_full.")
    prompt_weight: Finite = Field(
        default=1.0,
        description="Weight of a prompt token in a key's virtual token counter.")
    completion_weight: Finite = Field(
        default=2.0,
        description="Weight of a completion token in the counter (the VTC paper's "
                    "w_q = 2 w_p: a generated token costs about twice a prefill token).")
    poll_ms: Positive = Field(
        default=5,
        description="How often a waiting request looks whether it was dispatched, ms.")

    @model_validator(mode="after")
    def _bounds(self) -> QueueConfig:
        problems = []
        if self.key_max_requests > self.max_requests:
            why = f"{self.key_max_requests} exceeds max_requests ({self.max_requests})"
            problems.append(("key_max_requests", why))
        if self.key_max_tokens > self.max_tokens:
            why = f"{self.key_max_tokens} exceeds max_tokens ({self.max_tokens})"
            problems.append(("key_max_tokens", why))
        if problems:
            _check(problems)
        return self


class EdgeConfig(_Schema):
    """The nginx edge (``edge``), compiled to JSON for nginx.

    Coupled (checked on the whole file): ``global_limits_timeout_ms`` exceeds twice
    ``redis.timeout_ms`` (the limits sidecar's own Redis deadline), so a Redis outage
    reaches the edge as UNAVAILABLE rather than as a timeout; ``listen`` is neither a
    model's upstream (the edge would proxy to itself) nor, with global limits on,
    ``global_limits.listen``; nor is ``status_listen`` any of these.
    """

    listen: HostPort = Field(
        default="127.0.0.1:8080",
        description="host:port of the API. `make run`'s nginx listens on it; with the "
                    "Debian drop-in the host's `server { listen ...; }` that includes the "
                    "snippet serves the API instead: set this to that address (no upstream "
                    "may be it, or the edge would proxy to itself).")
    status_listen: LoopbackHostPort = Field(
        default="127.0.0.1:8081",
        description="Loopback host:port of the edge's status server (`/tokengate/status`), "
                    "a server of its own so the API listener never answers it.")
    client_body_timeout_s: Positive = Field(
        default=60,
        description="nginx's client_body_timeout: a client that sends nothing of its body "
                    "for this long gets 408 (the event's error: request_timeout), s.")
    body_deadline_s: Positive = Field(
        default=120,
        description="The whole request body's deadline, from the first read, s: a client "
                    "still sending after it gets 408 in the API's shape (the event's error: "
                    "request_timeout). client_body_timeout_s bounds each read only, so a "
                    "byte now and then would hold a request open for ever. 120 s lets a "
                    "4 MiB body (max_body_bytes' default) arrive at 35 KB/s.")
    max_body_bytes: int = Field(
        default=4 << 20, ge=1024, le=COUNTER_MAX_MESSAGE_BYTES,
        description="Largest request body, bytes (413 above it); at most the counter's gRPC "
                    "message limit, 64 MiB.")
    max_json_depth: int = Field(
        default=64, ge=4, le=MAX_COUNT,
        description="Deepest JSON nesting accepted (400 above it), levels.")
    count_timeout_ms: Positive = Field(
        default=500,
        description="How long admission waits for the counter, ms, per started 256 KiB of "
                    "body (a 1 MiB body may take 4 x this); then on_counter_failure "
                    "applies.")
    counter_backoff_ms: Count = Field(
        default=500,
        description="After a counter failure the edge skips the counter for this long, ms "
                    "(on_counter_failure applies meanwhile); then one request probes again.")
    on_counter_failure: Literal["open", "closed"] = Field(
        default="open",
        description="`open` forwards with a byte-length estimate (X-Token-Count-Source: "
                    "estimate); `closed` answers 503.")
    estimate_bytes_per_token: Positive = Field(
        default=3,
        description="Divisor of the fail-open estimate, bytes of body per token (3 "
                    "over-counts English and matches CJK, so limits stay on the safe side).")
    special_tokens: Literal["escape", "reject", "strip", "allow"] = Field(
        default="escape",
        description="Literal special-token strings (`<|im_end|>`) in the content, reasoning "
                    "and tool calls (names, and arguments as vLLM decodes them) of "
                    "special_token_roles messages and in every string of tools, documents "
                    "and chat_template_kwargs values; also the structural tokens of "
                    "structural_token_roles messages: `escape` (a U+200B inserted after "
                    "the token's leading punctuation, so the model reads the text and never "
                    "the control token; 1 token more per occurrence on Qwen3), `reject` "
                    "(400), `strip` or `allow`. Under escape and strip a token in an object "
                    "key is refused (never renamed).")
    special_token_roles: list[Role] = Field(
        default=["user", "assistant", "tool", "function"],
        description="Message roles whose text is checked for special tokens.")
    extra_special_tokens: list[NonEmpty] = Field(
        default=[],
        description="More strings treated like the tokenizer's special tokens.")
    structural_token_roles: list[Role] = Field(
        default=["user", "tool", "function"],
        description="Message roles whose text is checked, under the special_tokens policy, "
                    "for the model's structural tokens: added tokens that are not special but "
                    "appear literally in its chat template (Qwen3: `<tool_call>`, "
                    "`</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, "
                    "`</think>`), with which a user could write a fake tool response. "
                    "Assistant messages are left out by default: a model's own history holds "
                    "`<think>` and `<tool_call>` blocks. Tools, documents and the values of "
                    "chat_template_kwargs are checked for both kinds of token whatever the "
                    "roles say.")
    chat_template_kwargs_allowed: Annotated[
        list[NonEmpty], AfterValidator(_template_kwargs)] = Field(
        default=["enable_thinking", "reasoning_effort"],
        description="Keys a request may pass in chat_template_kwargs (Qwen3's template reads "
                    "`enable_thinking`; vLLM sets `reasoning_effort` and `enable_thinking` "
                    "from the request's reasoning_effort); any other key is refused with 400 "
                    "naming `chat_template_kwargs.<key>`, by the edge and the counter alike. "
                    "String values are checked like message text. messages, tools, "
                    "documents, add_generation_prompt, continue_final_message, chat_template "
                    "and tokenize can never be allowed.")
    structured_output: StructuredOutputLimits = Field(
        default_factory=StructuredOutputLimits,
        description="Bounds on response_format, structured_outputs and guided_* (work vLLM "
                    "does before the first token, whatever the prompt costs).")
    max_unknown_fields_bytes: Count = Field(
        default=65536,
        description="Total JSON size of the top-level fields that vLLM 0.32's request "
                    "models do not define (vLLM ignores them; the edge still reads and "
                    "forwards them), bytes; 400 above it, naming the largest.")
    count_cache_entries: Positive = Field(
        default=4096,
        description="Per-worker LRU of the counts of identical bodies, entries.")
    upstream_retry_after_s: Positive = Field(
        default=5,
        description="Retry-After of a 502/503 for an unreachable backend, s.")
    upstream_max_fails: Positive = Field(
        default=1,
        description="Failures of a replica (connect error, or no answer before the "
                    "connection broke) within upstream_eject_s that take it out.")
    upstream_eject_s: Positive = Field(
        default=10,
        description="Without health probes, how long a failed replica is skipped, s; "
                    "with probes it is out until a probe answers 200.")
    upstream_health_interval_ms: Count = Field(
        default=2000,
        description="Every this many ms one nginx worker probes each replica's /health; "
                    "a replica that does not answer 200 is out until it does. 0: no probes.")
    upstream_health_timeout_ms: Positive = Field(
        default=1000,
        description="How long a health probe waits for the answer's status line, ms.")
    upstream_resolve_interval_ms: Count = Field(
        default=30000,
        description="Every this many ms one nginx worker resolves the upstreams given by "
                    "host name again (DNS A records), so a replica that moves is followed "
                    "without a reload. 0: only when the configuration is compiled.")
    dns_resolvers: list[HostPort] = Field(
        default=[],
        description="DNS servers (host:port) the edge asks for the upstreams given by "
                    "name; empty: the nameservers of /etc/resolv.conf. With servers set, "
                    "such names are resolved by the edge only (a replica is out until its "
                    "name resolves). Names /etc/hosts gives are resolved once, when "
                    "compiling.")
    usage_file: RelPath = Field(
        default=Path("var/usage/usage.jsonl"), validate_default=True,
        description="Usage event file the edge writes. Default: ledger.usage_file.")
    global_limits_timeout_ms: Positive = Field(
        default=1000,
        description="With global_limits.enabled: how long admission waits for the "
                    "global-limit sidecar before admitting on the local limits alone, ms; "
                    "more than 2 x redis.timeout_ms (the sidecar's deadline, a retry "
                    "included), with room for the hop and a loaded host.")
    global_limits_backoff_ms: Count = Field(
        default=500,
        description="After a failure of the global tier, requests skip it (local limits "
                    "only) for this long, ms; then one request probes again.")
    auth_failures: AuthFailuresConfig = Field(
        default_factory=AuthFailuresConfig,
        description="Requests without a valid API key: counted, logged at a bounded rate, "
                    "and clients that keep failing blocked for a while.")
    cors: CorsConfig = Field(
        default_factory=CorsConfig,
        description="Browsers calling the API from other origins: which origins may, and "
                    "how long a preflight's answer is cached. Off by default.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig,
        description="KV-cache-aware admission: replicas too full for a key's priority take "
                    "no new request; when all are, 503 overloaded with Retry-After.")
    queue: QueueConfig = Field(
        default_factory=QueueConfig,
        description="Fair queueing in tokens: requests no replica can take now wait in "
                    "per-key queues served by virtual token counters (off: they are "
                    "answered 503 overloaded).")
