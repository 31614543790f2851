"""A simulated vLLM replica with a real prefix cache (``tokenstorm sim-replica``).

It answers like vLLM 0.32's OpenAI server (``/v1/chat/completions`` and
``/v1/completions``, streamed or not, with ``stream_options`` ``include_usage`` and
``continuous_usage_stats``; ``/v1/models``, ``/health``, ``/version``, ``/metrics``,
``POST /reset_prefix_cache``) and keeps the KV cache a GPU would, so that prefix-aware
routing can be measured with many replicas on a machine without GPUs:

- **Prompt tokens as vLLM counts them**: the model directory's own tokenizer and chat
  template through transformers, as ``vllm/renderers/hf.py`` does: chat is
  ``apply_chat_template(messages, tools=..., add_generation_prompt=True,
  tokenize=False, **chat_template_kwargs)`` encoded with ``add_special_tokens=False``
  (a message's list of text parts is joined with newlines, vLLM's "string" content
  format); a completions prompt is encoded with the tokenizer's special tokens, or
  taken as given when it is a list of token ids. ``--tokenizer counter`` encodes the
  same text with tokengate's counter tokenizer instead (its tiktoken path is proven
  identical to HF ``tokenizers``; about 5x faster), for scale runs.
- **Prefix cache**: a prompt's full blocks are hashed with ``tokengate.prefix_hash``
  (``--block-size``, ``--prefix-caching-hash-algo``, ``--hash-seed``, the request's
  ``cache_salt``), cached in a pool of ``--num-gpu-blocks`` blocks
  (``tokenstorm.upstream.kv_cache``: held while a request runs, then kept until
  evicted least recently used first); a request's hit is its leading cached blocks,
  capped by ``prefix_hash.cacheable_blocks``, and is reported as
  ``usage.prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``
  is always on here). The generated tokens fill blocks too (one fixed token id,
  ``" tok"`` in Qwen's vocabulary), cached as vLLM caches a running request's blocks.
- **KV events** (``--kv-events-endpoint``): ``BlockStored``, ``BlockRemoved`` and
  ``AllBlocksCleared`` in vLLM's wire format (``tokenstorm.upstream.kv_events``), one
  batch per scheduling step; hashes as 64-bit integers as vLLM sends them by default,
  or whole (``--kv-events-hashes bytes``).
- **Timing** (``--gpu``): steps as vLLM's V1 scheduler (token budget, running requests
  first, chunked prefill, ``--max-num-seqs``, preemption when the KV cache is short),
  each step timed by a roofline of ``--model-config`` on the GPU
  (``tokenstorm.upstream.sim_steps``, ``tokenstorm.upstream.roofline``). How late the
  host ran each step against its plan (a CPU that ran other work: a GPU's step never
  waits for it) is ``/metrics``' ``tokenstorm_sim_step_lateness_seconds`` histogram;
  the startup heap is frozen out of the garbage collector's view, as vLLM freezes its.
- **Timing** (without ``--gpu``, fixed): one prefill queue per replica at ``--prefill-tokens-per-s`` for the
  uncached prompt tokens (first come, first served), so TTFT = queue wait + uncached /
  rate + ``--ttft-overhead-ms``; then one token every ITL = ``--itl-ms`` x (1 +
  ``--itl-growth`` x (running - 1)), for all choices at once. At most
  ``--max-num-seqs`` requests run; the others wait (``vllm:num_requests_waiting``), in
  order, also while the KV cache has no room for the next one's blocks.
- **Scheduling policy** (``--scheduling-policy``, vLLM's): ``fcfs`` (default), or
  ``priority``: waiting requests by the body's ``priority`` (lower first), then
  arrival; with ``--gpu``, a KV cache too short for the running requests preempts the
  lowest-priority, latest-arriving one (``tokenstorm.upstream.sim_priority``). A waiting
  request never preempts a running one for a seat, in vLLM as here.
- **Output**: every request generates exactly its max_tokens (as vLLM with
  ``ignore_eos``); without max_tokens, the rest of the context for chat and 16 for
  completions, as vLLM.
- **Engine usage records** (``--engine-usage-file``): one line per finished request and
  choice, aborted ones included, as tokengate's vLLM plugin writes them
  (``tokengate_vllm.record``'s format, appended by its ``RecordWriter``), so the ledger
  settles a simulated replica's requests with the engine's numbers too: a stream the
  client (or the edge) left pays exactly the tokens generated. The records name the API
  key and endpoint the edge sent (``X-Tokengate-Key``, ``X-Tokengate-Endpoint``, read by
  the plugin's own middleware, ``tokengate_vllm.edge.EdgeHeaders``), so the ledger bills
  a record whose usage event never came (an nginx killed mid-stream) to its key. The record's counts add up
  to ``/metrics`` as vLLM's do: Σ ``num_generation_tokens`` = ``vllm:generation_tokens``,
  Σ ``num_prompt_tokens`` of the prefilled records = ``vllm:prompt_tokens`` (a prompt
  once per choice, as vLLM counts an ``n > 1`` request's children).

Simplifications of the fixed timing (against vLLM's scheduler,
``vllm/v1/core/sched/scheduler.py``; ``--gpu`` lifts the first two): a request is
admitted only when the blocks for its whole output are free, so nothing is ever preempted; prefill and decode do not slow each other; the choices of ``n > 1``
share one prefill and only the first one's generated blocks are cached (the counters and
records still count the prompt once per choice, as vLLM does).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from tokengate_vllm import edge
from tokengate_vllm import record as engine_record
from tokengate_vllm.writer import RecordWriter

from tokenstorm.null_server import LocalServer
from tokenstorm.process import Service, http_ready
from tokenstorm.upstream.kv_events import KVEventPublisher
from tokenstorm.upstream.sim_engine import Engine, SimRequest, engine_records
from tokenstorm.upstream.sim_prompts import BadRequest, PromptRenderer
from tokenstorm.upstream.sim_settings import SimSettings
from tokenstorm.upstream.sim_steps import SteppedEngine

VLLM_VERSION = "0.32.0"
# vLLM's TTFT histogram buckets, s (vllm/v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# the simulator's own: how late the host ran each step (SteppedEngine's on_late), s
LATE_METRIC = "tokenstorm_sim_step_lateness_seconds"
LATE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


def _dumps(obj: Any) -> str:
    """Compact JSON, as pydantic's model_dump_json writes vLLM's answers."""
    return msgspec.json.encode(obj).decode()


def _usage(p: int, c: int, details: str) -> str:
    return f'{{"prompt_tokens":{p},"total_tokens":{p + c},"completion_tokens":{c}{details}'


class SimServer:
    """The HTTP side: vLLM's routes over an ``Engine`` (built at start-up)."""

    def __init__(self, s: SimSettings) -> None:
        s.check()
        self.s = s
        self.renderer = PromptRenderer(s.model_dir, s.tokenizer)
        self.records = RecordWriter(s.engine_usage_file) \
            if s.engine_usage_file is not None else None
        self.engine: Engine | None = None
        self.publisher: KVEventPublisher | None = None
        self.created = int(time.time())
        self.model_json = _dumps(s.model)
        digest = hashlib.sha256(s.model.encode()).hexdigest()[:8]
        self.fp_json = _dumps(f"vllm-{VLLM_VERSION}-{digest}")
        self.piece = _dumps(self.renderer.output_text)[1:-1]
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              ["model_name", "engine"], buckets=TTFT_BUCKETS,
                              registry=self.registry).labels(s.model, "0")
        self.late = Histogram(LATE_METRIC,
                              "How late the event loop ended each engine step against its "
                              "planned end (--gpu): the host's scheduling, which a GPU's "
                              "step never waits for, in seconds.",
                              ["model_name", "engine"], buckets=LATE_BUCKETS,
                              registry=self.registry).labels(s.model, "0")
        self.registry.register(_EngineCollector(self))

    def app(self) -> Any:
        """The Starlette application."""
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.routing import Route

        @contextlib.asynccontextmanager
        async def lifespan(_app: Any) -> AsyncIterator[None]:
            s = self.s
            if s.kv_events_endpoint:
                self.publisher = KVEventPublisher(s.kv_events_endpoint,
                                                  s.kv_events_replay_endpoint,
                                                  s.kv_events_topic,
                                                  int_hashes=s.kv_events_int_hashes)
                self.publisher.start()
            on_finish = self._write_records if self.records is not None else None
            roofline = s.roofline()
            self.engine = Engine(s, self.renderer.output_token_id, self.publisher,
                                 self.ttft.observe, on_finish) if roofline is None else \
                SteppedEngine(s, roofline, self.renderer.output_token_id, self.publisher,
                              self.ttft.observe, on_finish, self.late.observe)
            # vLLM's freeze_gc_heap (vllm/utils/gc_utils.py, called once its engine core
            # and API server have started): the startup heap (about 420,000 objects in
            # a `make bench-slo` replica) leaves the collector's view, so a collection
            # of the oldest generation no longer stalls every stream of the replica for
            # a quarter of a second in the middle of a run
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                if self.publisher is not None:
                    self.publisher.close()
                if self.records is not None:
                    self.records.close()

        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
        ]
        # the plugin's middleware, as vLLM loads it (--middleware): the edge's key and
        # endpoint of each request, for its engine records
        return Starlette(routes=routes, lifespan=lifespan,
                         middleware=[Middleware(edge.EdgeHeaders)])

    def _write_records(self, r: SimRequest) -> None:
        """Append ``r``'s engine usage records (one write, as the plugin's batch)."""
        assert self.records is not None and self.engine is not None
        self.records.write([engine_record.to_line(rec) for rec in
                            engine_records(r, self.s.model, self.engine.loop.time())])

    # -- simple routes ------------------------------------------------------------------

    async def health(self, _request: Any) -> Any:
        from starlette.responses import Response

        return Response(b"", status_code=200)

    async def version(self, _request: Any) -> Any:
        return self._json(200, _dumps({"version": VLLM_VERSION}))

    async def models(self, _request: Any) -> Any:
        s = self.s
        body = {"object": "list", "data": [{
            "id": s.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": str(s.model_dir), "parent": None, "max_model_len": s.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                "created": self.created, "allow_create_engine": False,
                "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False}]}]}
        return self._json(200, _dumps(body))

    async def metrics(self, _request: Any) -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self, _request: Any) -> Any:
        assert self.engine is not None
        return self._json(200, _dumps({"success": self.engine.reset_prefix_cache()}))

    @staticmethod
    def _json(status: int, body: str) -> Any:
        from starlette.responses import Response

        return Response(body.encode(), status_code=status, media_type="application/json")

    def _error(self, e: BadRequest) -> Any:
        return self._json(e.status, _dumps({"error": {"message": str(e), "type": e.etype,
                                                      "param": e.param, "code": e.status}}))

    # -- completions --------------------------------------------------------------------

    async def chat(self, request: Any) -> Any:
        return await self._complete(request, "chat")

    async def completions(self, request: Any) -> Any:
        return await self._complete(request, "completion")

    def _parse(self, raw: bytes, ctype: str, kind: str) -> tuple[dict[str, Any], int]:
        """The body and its max_tokens, checked as vLLM checks them; BadRequest."""
        if "application/json" not in ctype:
            raise BadRequest("1 validation error:\n  Unsupported Media Type: Only "
                             "'application/json' is allowed", "Bad Request")
        try:
            body = msgspec.json.decode(raw)  # a 2,000-token body: 5x faster than json
        except msgspec.DecodeError as e:
            raise BadRequest(f"JSON decode error: {e}", "Bad Request", "body") from e
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", "Bad Request", "body")
        field = "messages" if kind == "chat" else "prompt"
        if body.get(field) is None:
            raise BadRequest(f"1 validation error:\n  {{'type': 'missing', 'loc': "
                             f"'body.{field}', 'msg': 'Field required'}}", "Bad Request",
                             f"body.{field}")
        model = body.get("model")
        if model is not None and model != self.s.model:
            raise BadRequest(f"The model `{model}` does not exist. Valid aliases: "
                             f"{self.s.model}.", "NotFoundError", "model", 404)
        max_tokens = body.get("max_tokens")
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            max_tokens = body["max_completion_tokens"]
        limit = self.s.max_model_len
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise BadRequest("max_tokens: Input should be a valid integer",
                                 "Bad Request", "body.max_tokens")
            if max_tokens < 1:
                raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}. "
                                 f"(parameter=max_tokens, value={max_tokens})",
                                 param="max_tokens")
            if max_tokens > limit:
                raise BadRequest(f"max_tokens={max_tokens} cannot be greater than "
                                 f"max_model_len={limit}. Please request fewer output "
                                 f"tokens. (parameter=max_tokens, value={max_tokens})",
                                 param="max_tokens")
        n = body.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int):
            raise BadRequest("n: Input should be a valid integer", "Bad Request", "body.n")
        if n < 1:
            raise BadRequest(f"n must be at least 1, got {n}.")
        if n > 1 and body.get("temperature") == 0:
            raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.")
        if body.get("stream_options") is not None and body.get("stream") is not True:
            raise BadRequest("Stream options can only be defined when `stream=True`. "
                             "(parameter=stream_options)", param="stream_options")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("cache_salt must be a string", "Bad Request", "body.cache_salt")
        priority = body.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not -2**63 <= priority < 2**63:
            raise BadRequest("priority: Input should be a valid 64-bit integer",
                             "Bad Request", "body.priority")
        return body, -1 if max_tokens is None else max_tokens

    async def _complete(self, request: Any, kind: str) -> Any:
        from starlette.responses import StreamingResponse

        engine = self.engine
        assert engine is not None
        try:
            body, max_tokens = self._parse(await request.body(),
                                           request.headers.get("content-type", ""), kind)
            ids = self.renderer.chat(body) if kind == "chat" else \
                self.renderer.completion(body)
            p, limit = len(ids), self.s.max_model_len
            if p > limit:
                raise BadRequest(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt contains at least {limit + 1} input tokens, which exceeds this "
                    f"limit even without any output tokens. Please reduce the length of the "
                    f"input prompt. (parameter=input_tokens, value={p})",
                    param="input_tokens")
            asked = None if max_tokens < 0 else max_tokens
            if max_tokens < 0:  # vLLM's default: the rest of the context (chat), 16
                max_tokens = limit - p if kind == "chat" else 16
            c = min(max_tokens, limit - p)  # clamped, not refused
            if c < 1:
                raise BadRequest(f"max_tokens must be at least 1, got {c}. "
                                 f"(parameter=max_tokens, value={c})", param="max_tokens")
            n = int(body.get("n") or 1)
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
            # vLLM's engine request of a completions prompt adds its index (one prompt here)
            r = engine.submit(ids, c, n, body.get("cache_salt") or None,
                              rid if kind == "chat" else f"{rid}-0", asked, edge.current(),
                              body.get("priority", 0))
        except BadRequest as e:
            return self._error(e)
        created = int(time.time())
        if body.get("stream") is True:
            so = body.get("stream_options") or {}
            include_usage = isinstance(so, dict) and so.get("include_usage") is True
            continuous = isinstance(so, dict) and so.get("continuous_usage_stats") is True
            return StreamingResponse(
                self._stream(r, kind, rid, created, include_usage, continuous),
                media_type="text/event-stream")
        try:
            await r.done
        finally:
            engine.abort(r)  # no-op once finished; frees what a left client held
        return self._json(200, self._body(r, kind, rid, created))

    def _body(self, r: SimRequest, kind: str, rid: str, created: int) -> str:
        c, p = r.max_tokens, r.prompt_len
        text = self.renderer.output_text * c
        if kind == "chat":
            choices: list[dict[str, Any]] = [
                {"index": i, "message": {"role": "assistant", "content": text, "refusal": None,
                                         "annotations": None, "audio": None,
                                         "function_call": None, "reasoning": None},
                 "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "token_ids": None, "routed_experts": None} for i in range(r.n)]
            created_cache: int | None = r.created_cache_tokens
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": "length",
                        "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                        "prompt_token_ids": None, "routed_experts": None}
                       for i in range(r.n)]
            created_cache = None
        usage = {"prompt_tokens": p, "total_tokens": p + c * r.n,
                 "completion_tokens": c * r.n,
                 "prompt_tokens_details": {"cached_tokens": r.cached_tokens,
                                           "created_cache_tokens": created_cache,
                                           "multimodal_tokens": None},
                 "completion_tokens_details": None}
        body: dict[str, Any] = {
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": self.s.model, "choices": choices,
            "service_tier": None, "system_fingerprint": msgspec.json.decode(self.fp_json),
            "usage": usage}
        if kind == "chat":
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return _dumps(body)

    async def _stream(self, r: SimRequest, kind: str, rid: str, created: int,
                      include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        """vLLM's SSE events: the role events (chat) with the first token after TTFT,
        then each token as it is generated, the usage chunk and ``[DONE]``."""
        engine = self.engine
        assert engine is not None
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                f'"model":{self.model_json},"choices":')
        per_chunk = include_usage and continuous
        cdetails = ',"completion_tokens_details":null}' if chat else "}"
        p, c, n = r.prompt_len, r.max_tokens, r.n
        sent = 0
        try:
            while sent < c:
                if r.generated <= sent:
                    if r.finished:
                        return  # aborted
                    r.waiter = engine.loop.create_future()
                    await r.waiter
                    r.waiter = None
                    continue
                out: list[str] = []
                if sent == 0 and chat:
                    for i in range(n):
                        out.append(
                            f'{head}[{{"index":{i},"delta":{{"role":"assistant","content":""}},'
                            f'"logprobs":null,"finish_reason":null}}]'
                            + (f',"usage":{_usage(p, 0, cdetails)}' if per_chunk else "")
                            + ',"prompt_token_ids":null,"prompt_text":null}\n\n')
                for t in range(sent + 1, r.generated + 1):
                    last = t == c
                    if last:
                        finish = '"finish_reason":"length","stop_reason":null'
                    elif chat:
                        finish = '"finish_reason":null'
                    else:
                        finish = '"finish_reason":null,"stop_reason":null'
                    if per_chunk:
                        tail = f',"usage":{_usage(p, t, cdetails)}}}\n\n'
                    elif last and not include_usage:
                        tail = f',"system_fingerprint":{self.fp_json}}}\n\n'
                    else:
                        tail = "}\n\n"
                    for i in range(n):
                        if chat:
                            choice = (f'[{{"index":{i},"delta":{{"content":"{self.piece}"}},'
                                      f'"logprobs":null,{finish},"token_ids":null}}]')
                        else:
                            choice = (f'[{{"index":{i},"text":"{self.piece}","logprobs":null,'
                                      f'{finish},"prompt_token_ids":null,"token_ids":null}}]')
                        out.append(head + choice + tail)
                sent = r.generated
                if sent >= c:
                    if include_usage:
                        if chat:
                            pdetails = (f',"prompt_tokens_details":{{"cached_tokens":'
                                        f'{r.cached_tokens},"created_cache_tokens":'
                                        f'{r.created_cache_tokens}}}}}')
                        else:
                            pdetails = (f',"prompt_tokens_details":{{"cached_tokens":'
                                        f'{r.cached_tokens}}}}}')
                        out.append(f'{head}[],"usage":{_usage(p, c * n, pdetails)},'
                                   f'"system_fingerprint":{self.fp_json}}}\n\n')
                    out.append("data: [DONE]\n\n")
                yield "".join(out)
        finally:
            engine.abort(r)  # no-op once finished


class _EngineCollector:
    """vLLM's engine metrics (``vllm/v1/metrics/loggers.py``: names, help, labels
    ``model_name`` and ``engine``) read from the engine at each scrape."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        srv, s = self.server, self.server.s
        e = srv.engine
        labels = ["model_name", "engine"]
        values = [s.model, "0"]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, v)
            return c

        running = len(e.running) if e else 0
        waiting = len(e.waiting) if e else 0
        yield gauge("vllm:num_requests_running",
                    "Number of requests in model execution batches.", running)
        yield gauge("vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    e.pool.usage if e else 0.0)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      e.prefix_cache_queries if e else 0)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      e.prefix_cache_hits if e else 0)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      e.prompt_tokens if e else 0)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      e.generation_tokens if e else 0)
        ok = CounterMetricFamily("vllm:request_success",
                                 "Count of successfully processed requests.",
                                 labels=["model_name", "engine", "finished_reason"])
        for reason, count in sorted((e.finished if e else {}).items()):
            ok.add_metric([s.model, "0", reason], count)
        yield ok
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks",
                    "prefix_caching_hash_algo"])
        info.add_metric([str(s.block_size), "True", "0", str(s.num_gpu_blocks),
                         s.hash_algo], 1.0)
        yield info


def serve(s: SimSettings, host: str = "127.0.0.1", port: int = 38200) -> None:
    """Run a simulated replica in the foreground until SIGINT or SIGTERM."""
    import prometheus_client
    import uvicorn

    prometheus_client.disable_created_metrics()  # as vLLM's own /metrics
    server = SimServer(s)
    timing = f"prefill {s.prefill_tokens_per_s:g} tokens/s, ITL {s.itl_ms:g} ms" \
        if s.gpu is None else f"vLLM's steps, roofline of {s.model_config} on {s.gpu}"
    print(f"simulated vLLM replica on http://{host}:{port}/v1 (model {s.model}, "
          f"{s.num_gpu_blocks} blocks of {s.block_size} tokens, {timing}"
          + (f", KV events on {s.kv_events_endpoint}" if s.kv_events_endpoint else "")
          + ")", flush=True)
    uvicorn.run(server.app(), host=host, port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools", lifespan="on", backlog=4096,
                timeout_keep_alive=5,  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE
                timeout_graceful_shutdown=2)  # streams still open are cut after 2 s


class SimReplica(LocalServer):
    """``with SimReplica(settings) as rep: rep.url`` runs a simulated replica process
    (``tokenstorm sim-replica``) on a free loopback port meanwhile; its log goes to
    ``state_dir`` (default: a temporary folder, removed at the end)."""

    def __init__(self, settings: SimSettings, port: int | None = None,
                 name: str = "sim-replica", state_dir: Path | None = None,
                 host: str = "127.0.0.1") -> None:
        self.settings = settings
        super().__init__(port, state_dir, host, "tokenstorm-sim-")
        argv = [sys.executable, "-m", "tokenstorm.cli", "sim-replica", "--host", host,
                "--port", str(self.port), *settings.argv()]
        self.service = Service(f"{name}-{self.port}", argv,
                               http_ready(f"http://{host}:{self.port}/health"),
                               start_timeout_s=60.0, log_dir=self.state_dir / "log")
