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
- **Timing**: one prefill queue per replica at ``--prefill-tokens-per-s`` for the
  uncached prompt tokens (first come, first served), so TTFT = queue wait + uncached /
  rate + ``--ttft-overhead-ms``; then one token every ITL = ``--itl-ms`` x (1 +
  ``--itl-growth`` x (running - 1)), for all choices at once. At most
  ``--max-num-seqs`` requests run; the others wait (``vllm:num_requests_waiting``), in
  order, also while the KV cache has no room for the next one's blocks.
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

Simplifications (against vLLM's scheduler, ``vllm/v1/core/sched/scheduler.py``): a
request is admitted only when the blocks for its whole output are free, so nothing is
ever preempted; prefill and decode do not slow each other; the choices of ``n > 1``
share one prefill and only the first one's generated blocks are cached (the counters and
records still count the prompt once per choice, as vLLM does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import heapq
import math
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from tokengate import prefix_hash
from tokengate.process import Service, http_ready
from tokengate_vllm import edge
from tokengate_vllm import record as engine_record
from tokengate_vllm.writer import RecordWriter

from tokenstorm.null_server import LocalServer
from tokenstorm.upstream.kv_cache import Block, BlockPool
from tokenstorm.upstream.kv_events import KVEventPublisher

VLLM_VERSION = "0.32.0"
OUTPUT_PIECE = " tok"   # the text of every generated token (one token in Qwen's vocabulary)
# vLLM's TTFT histogram buckets, s (vllm/v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(frozen=True)
class SimSettings:
    """How one simulated replica behaves (each field is a ``sim-replica`` flag).

    ``model``: served model name; ``model_dir``: its directory (tokenizer, chat
    template); ``max_model_len`` (tokens); ``block_size`` (tokens per KV block, vLLM's
    ``--block-size``); ``hash_algo`` (``--prefix-caching-hash-algo``: sha256 or
    sha256_cbor); ``hash_seed`` (the PYTHONHASHSEED a real replica would run with; None:
    vLLM's fixed seed); ``num_gpu_blocks`` (KV-cache blocks, vLLM's
    ``--num-gpu-blocks-override``; block 0 is never used); ``max_num_seqs`` (requests
    running at once); ``prefill_tokens_per_s`` (uncached prompt tokens per second);
    ``ttft_overhead_ms`` (ms added to every TTFT); ``itl_ms`` (ms between tokens with
    one request running); ``itl_growth`` (ITL grows by this fraction per other running
    request); ``kv_events_endpoint`` / ``kv_events_replay_endpoint`` / ``kv_events_topic``
    (vLLM's ``--kv-events-config`` endpoint, replay_endpoint and topic; no endpoint: no
    events); ``kv_events_int_hashes``: hashes in events as 64-bit integers (vLLM's
    default) or 32-byte digests (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``);
    ``tokenizer``: ``hf`` (transformers, as vLLM) or ``counter``;
    ``engine_usage_file``: where the engine usage records go (vLLM's
    ``TOKENGATE_ENGINE_USAGE_FILE`` with the plugin; None: none are written).

    Defaults: a GPU-like replica where a 6,000-token prefix costs 300 ms of prefill
    (20,000 tokens/s) and decoding 15 ms a token; 8,192 blocks of 16 tokens (131,056
    tokens: about 21 such prefixes).
    """

    model: str = "tiny-qwen3"
    model_dir: Path = Path("var/models/tiny-qwen3")
    max_model_len: int = 8192
    block_size: int = prefix_hash.DEFAULT_BLOCK_SIZE
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 256
    prefill_tokens_per_s: float = 20000.0
    ttft_overhead_ms: float = 5.0
    itl_ms: float = 15.0
    itl_growth: float = 0.0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_int_hashes: bool = True
    tokenizer: str = "hf"
    engine_usage_file: Path | None = None

    def check(self) -> None:
        """ValueError naming the first setting that cannot work."""
        if self.hash_algo not in prefix_hash.ALGOS:
            raise ValueError(f"--prefix-caching-hash-algo {self.hash_algo!r}: one of "
                             f"{', '.join(prefix_hash.ALGOS)}")
        if self.block_size < 1 or self.max_model_len < 1 or self.max_num_seqs < 1:
            raise ValueError("--block-size, --max-model-len and --max-num-seqs must be >= 1")
        if self.prefill_tokens_per_s <= 0 or self.itl_ms < 0 or self.ttft_overhead_ms < 0 \
                or self.itl_growth < 0:
            raise ValueError("--prefill-tokens-per-s must be > 0; --itl-ms, "
                             "--ttft-overhead-ms and --itl-growth >= 0")
        if self.tokenizer not in ("hf", "counter"):
            raise ValueError("--tokenizer: hf or counter")
        # vLLM refuses to start when one request of max_model_len tokens cannot fit
        # (vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory)
        room = (self.num_gpu_blocks - 1) * self.block_size
        if room < self.max_model_len:
            raise ValueError(f"--num-gpu-blocks {self.num_gpu_blocks} holds {max(room, 0)} "
                             f"tokens, fewer than --max-model-len {self.max_model_len}")

    def argv(self) -> list[str]:
        """The ``tokenstorm sim-replica`` flags that give these settings."""
        out = ["--model", self.model, "--model-dir", str(self.model_dir),
               "--max-model-len", str(self.max_model_len),
               "--block-size", str(self.block_size),
               "--prefix-caching-hash-algo", self.hash_algo,
               "--num-gpu-blocks", str(self.num_gpu_blocks),
               "--max-num-seqs", str(self.max_num_seqs),
               "--prefill-tokens-per-s", repr(self.prefill_tokens_per_s),
               "--ttft-overhead-ms", repr(self.ttft_overhead_ms),
               "--itl-ms", repr(self.itl_ms), "--itl-growth", repr(self.itl_growth),
               "--tokenizer", self.tokenizer]
        if self.hash_seed is not None:
            out += ["--hash-seed", self.hash_seed]
        if self.kv_events_endpoint:
            out += ["--kv-events-endpoint", self.kv_events_endpoint,
                    "--kv-events-topic", self.kv_events_topic,
                    "--kv-events-hashes", "int" if self.kv_events_int_hashes else "bytes"]
        if self.kv_events_replay_endpoint:
            out += ["--kv-events-replay-endpoint", self.kv_events_replay_endpoint]
        if self.engine_usage_file is not None:
            out += ["--engine-usage-file", str(self.engine_usage_file)]
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``sim-replica`` command's flags (``SimSettings``'s fields, plus --host,
    --port, --config)."""
    d = SimSettings()
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on "
                   "(default: %(default)s)")
    g.add_argument("--port", type=int, default=38200, help="HTTP port: /v1/chat/completions, "
                   "/v1/completions, /v1/models, /health, /version, /metrics, "
                   "POST /reset_prefix_cache (default: %(default)s)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="tokengate.yaml for the defaults of --model, --model-dir and "
                        "--max-model-len (its first model)")
    g.add_argument("--model", "--served-model-name", dest="model", default=None,
                   help="served model name (default: from the config)")
    g.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                   help="the model's directory: tokenizer and chat template "
                        "(default: from the config)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="context length, as vLLM's (default: from the config)")
    g.add_argument("--tokenizer", choices=("hf", "counter"), default=d.tokenizer,
                   help="hf: transformers, as vLLM (default); counter: tokengate's "
                        "counter tokenizer, same ids, faster")
    g.add_argument("--engine-usage-file", type=Path, default=None, metavar="FILE",
                   help="append an engine usage record per finished request, as "
                        "tokengate's vLLM plugin does with TOKENGATE_ENGINE_USAGE_FILE "
                        "(default: none)")
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=d.block_size, metavar="TOKENS",
                   help="tokens per KV block, vLLM's --block-size (default: %(default)s)")
    c.add_argument("--prefix-caching-hash-algo", dest="hash_algo", default=d.hash_algo,
                   choices=prefix_hash.ALGOS, help="default: %(default)s")
    c.add_argument("--hash-seed", default=None, metavar="SEED",
                   help="the PYTHONHASHSEED of the replica being simulated (default: none, "
                        "vLLM's fixed seed)")
    c.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, metavar="N",
                   help="KV-cache blocks, vLLM's --num-gpu-blocks-override "
                        "(default: %(default)s)")
    c.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ",
                   help="publish KV events on this ZMQ PUB address, e.g. "
                        "tcp://127.0.0.1:5557 (it binds there; subscribers connect)")
    c.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ",
                   help="answer replay requests on this ZMQ ROUTER address")
    c.add_argument("--kv-events-topic", default=d.kv_events_topic, metavar="TOPIC",
                   help="first frame of every event message (default: none)")
    c.add_argument("--kv-events-hashes", choices=("int", "bytes"), default="int",
                   help="block hashes in events: int, their low 64 bits (vLLM's default), "
                        "or bytes, the 32-byte digests (vLLM with "
                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) (default: %(default)s)")
    t = p.add_argument_group("timing")
    t.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help="requests running at once (default: %(default)s)")
    t.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
                   metavar="TOKENS_PER_S",
                   help="prefill speed for uncached prompt tokens (default: %(default)s)")
    t.add_argument("--ttft-overhead-ms", type=float, default=d.ttft_overhead_ms, metavar="MS",
                   help="added to every TTFT (default: %(default)s)")
    t.add_argument("--itl-ms", type=float, default=d.itl_ms, metavar="MS",
                   help="inter-token latency with one request running (default: %(default)s)")
    t.add_argument("--itl-growth", type=float, default=d.itl_growth, metavar="X",
                   help="ITL x (1 + X x (running - 1)) (default: %(default)s)")


def settings_from_args(args: argparse.Namespace, model: str, model_dir: Path,
                       max_model_len: int) -> SimSettings:
    """``SimSettings`` from parsed flags; ``model``, ``model_dir`` and
    ``max_model_len`` are the resolved defaults of the flags left out."""
    return SimSettings(
        model=args.model or model, model_dir=Path(args.model_dir or model_dir),
        max_model_len=args.max_model_len or max_model_len, block_size=args.block_size,
        hash_algo=args.hash_algo, hash_seed=args.hash_seed,
        num_gpu_blocks=args.num_gpu_blocks, max_num_seqs=args.max_num_seqs,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        ttft_overhead_ms=args.ttft_overhead_ms, itl_ms=args.itl_ms,
        itl_growth=args.itl_growth, kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_int_hashes=args.kv_events_hashes == "int", tokenizer=args.tokenizer,
        engine_usage_file=args.engine_usage_file)


# -- prompts ----------------------------------------------------------------------------


class BadRequest(ValueError):
    """A request vLLM would refuse: ``status``, OpenAI error ``etype`` and ``param``."""

    def __init__(self, message: str, etype: str = "BadRequestError",
                 param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.etype, self.param, self.status = etype, param, status


class PromptRenderer:
    """Token ids of a request's prompt, as vLLM computes them for the model directory.

    ``backend`` ``hf`` encodes with transformers (vLLM's own path); ``counter`` with
    ``tokengate.counter.tokenizer.PromptTokenizer`` (same ids, faster).
    """

    def __init__(self, model_dir: Path, backend: str = "hf") -> None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
        hf_encode: Callable[[str], list[int]] = \
            lambda text: list(self.tokenizer.encode(text, add_special_tokens=False))
        self._encode = hf_encode
        self._encode_special: Callable[[str], list[int]] = \
            lambda text: list(self.tokenizer.encode(text))
        if backend == "counter":
            from tokengate.counter.tokenizer import PromptTokenizer

            fast = PromptTokenizer.from_model_dir(Path(model_dir))
            self._encode = fast.encode
            if fast.added_by_post_processor == 0:
                self._encode_special = fast.encode
        ids = self._encode(OUTPUT_PIECE)
        # the id every generated token has, and its text
        self.output_token_id = ids[0]
        self.output_text = str(self.tokenizer.decode([self.output_token_id]))

    def chat(self, body: dict[str, Any]) -> list[int]:
        """The prompt of a chat request (``messages``, ``tools``,
        ``chat_template_kwargs``); BadRequest for what the template cannot take."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list", "Bad Request", "body.messages")
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role",
                                 "Bad Request", "body.messages")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"
                            and isinstance(part.get("text"), str)):
                        raise BadRequest(f"messages[{i}].content: only text parts are "
                                         "served here", "Bad Request", "body.messages")
                    texts.append(part["text"])
                m = {**m, "content": "\n".join(texts)}
            conv.append(m)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object", "Bad Request",
                             "body.chat_template_kwargs")
        tools = body.get("tools")
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # the template's raise_exception and jinja errors
            raise BadRequest(f"chat template: {e}") from e
        return self._encode(str(text))

    def completion(self, body: dict[str, Any]) -> list[int]:
        """The prompt of a completions request: a string (tokenized with the
        tokenizer's special tokens) or a list of token ids."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self._encode_special(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.completion({"prompt": prompt[0]})
        raise BadRequest("prompt: a string or a list of token ids (one prompt per request "
                         "here)", "Bad Request", "body.prompt")


# -- the engine -------------------------------------------------------------------------


class SimRequest:
    """One request in the engine. Times are the event loop's clock (s)."""

    __slots__ = (
        "arrival",
        "arrival_wall",
        "blocks",
        "cached_tokens",
        "created_cache_tokens",
        "done",
        "extra_blocks",
        "finish_reason",
        "first_token_at",
        "generated",
        "hashes",
        "key_endpoint",
        "last_token_at",
        "max_tokens",
        "max_tokens_param",
        "n",
        "next_at",
        "num_cached_blocks",
        "prompt_ids",
        "prompt_len",
        "request_id",
        "reserved",
        "salt",
        "scheduled_at",
        "waiter",
    )

    def __init__(self, prompt_ids: list[int], max_tokens: int, n: int, hashes: list[bytes],
                 salt: str | None, arrival: float, done: asyncio.Future[None],
                 request_id: str = "", max_tokens_param: int | None = None,
                 key_endpoint: tuple[str | None, str | None] = (None, None)) -> None:
        self.request_id = request_id   # vLLM's external id (the engine record's)
        self.max_tokens_param = max_tokens_param  # what the body asked for, or None
        self.key_endpoint = key_endpoint  # (key id, endpoint) the edge's headers named
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens   # tokens each choice generates
        self.n = n                     # choices
        self.hashes = hashes           # full blocks of the prompt + max_tokens - 1 outputs
        self.salt = salt
        self.blocks: list[Block] = []        # the first choice's, in token order
        self.extra_blocks: list[Block] = []  # the other choices' own blocks
        self.num_cached_blocks = 0     # leading blocks of ``blocks`` cached under a hash
        self.reserved = 0              # blocks still to allocate as tokens are generated
        self.cached_tokens = 0         # prefix-cache hit, tokens
        self.created_cache_tokens = 0  # prompt tokens this request's prefill cached
        self.generated = 0             # tokens generated per choice
        self.arrival = arrival
        self.arrival_wall = time.time()
        self.scheduled_at: float | None = None  # admitted from the waiting queue
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.next_at = 0.0
        self.finish_reason: str | None = None   # "length", or "abort" (client left)
        self.waiter: asyncio.Future[None] | None = None  # set at the next token
        self.done = done               # set when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Scheduler, prefill queue, decode clock and KV cache of one simulated replica
    (the rules: the module's text). Build it inside the running event loop.

    ``output_token_id``: the id of every generated token; ``publisher``: where the KV
    events go (None: nowhere); ``on_ttft``: called with each request's TTFT (s);
    ``on_finish``: called with each request once it finished, aborted ones included (its
    engine usage records).
    """

    def __init__(self, s: SimSettings, output_token_id: int,
                 publisher: KVEventPublisher | None = None,
                 on_ttft: Callable[[float], None] | None = None,
                 on_finish: Callable[[SimRequest], None] | None = None) -> None:
        self.s = s
        self.loop = asyncio.get_running_loop()
        self.output_token_id = output_token_id
        self.pool = BlockPool(s.num_gpu_blocks, s.block_size,
                              record_events=publisher is not None)
        self.publisher = publisher
        self.on_ttft = on_ttft
        self.on_finish = on_finish
        self.waiting: deque[SimRequest] = deque()
        self.running: set[SimRequest] = set()
        self.reserved = 0                # blocks promised to running requests' outputs
        self.prefill_free_at = 0.0       # when the prefill queue is idle
        self._decode: list[tuple[float, int, SimRequest]] = []  # (next token at, seq, r)
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._flush_pending = False
        # vLLM's counters (tokens, requests)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.finished: dict[str, int] = {}

    # -- requests -----------------------------------------------------------------------

    def blocks_needed(self, prompt_len: int, max_tokens: int, n: int) -> tuple[int, int, int]:
        """(blocks at prefill, more blocks the first choice fills while generating,
        blocks of the other choices) for a request; a running request holds their sum
        at its end. Its KV covers prompt + max_tokens - 1 tokens (the last token's is
        never computed)."""
        bs = self.s.block_size
        first = -(-prompt_len // bs)
        total = max(first, -(-(prompt_len + max_tokens - 1) // bs))
        return first, total - first, (n - 1) * (total - prompt_len // bs)

    def submit(self, prompt_ids: list[int], max_tokens: int, n: int = 1,
               salt: str | None = None, request_id: str = "",
               max_tokens_param: int | None = None,
               key_endpoint: tuple[str | None, str | None] = (None, None)) -> SimRequest:
        """Queue a request of ``prompt_ids`` generating ``max_tokens`` (>= 1) tokens for
        each of ``n`` choices; ``salt``: its cache_salt; ``request_id``: vLLM's external
        id, ``max_tokens_param``: the body's max_tokens, ``key_endpoint``: the (key id,
        endpoint) the edge sent (its engine usage records). BadRequest when its blocks cannot fit
        in the whole KV cache."""
        s = self.s
        now, prefill, extra = self.blocks_needed(len(prompt_ids), max_tokens, n)
        room = s.num_gpu_blocks - 1
        if now + prefill + extra > room:
            raise BadRequest(f"the request needs {now + prefill + extra} KV-cache blocks; "
                             f"the replica has {room}", param="n")
        tokens = prompt_ids + [self.output_token_id] * (max_tokens - 1)
        hashes = prefix_hash.block_hashes(tokens, s.block_size, s.hash_algo, s.hash_seed,
                                          salt)
        r = SimRequest(prompt_ids, max_tokens, n, hashes, salt, self.loop.time(),
                       self.loop.create_future(), request_id, max_tokens_param,
                       key_endpoint)
        self.waiting.append(r)
        self._schedule()
        return r

    def abort(self, r: SimRequest) -> None:
        """The client left: drop ``r`` from the queue, or free what it holds."""
        if r.finished:
            return
        if r in self.running:
            self._finish(r, "abort")
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(r)
        r.finish_reason = "abort"
        self.finished["abort"] = self.finished.get("abort", 0) + 1
        if self.on_finish is not None:
            self.on_finish(r)
        if not r.done.done():
            r.done.set_result(None)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``POST /reset_prefix_cache``: False while a request holds blocks."""
        ok = self.pool.reset()
        self._events_changed()
        return ok

    # -- scheduling ---------------------------------------------------------------------

    def _schedule(self) -> None:
        """Admit waiting requests in order while a slot and their blocks are free."""
        s, pool, bs = self.s, self.pool, self.s.block_size
        while self.waiting and len(self.running) < s.max_num_seqs:
            r = self.waiting[0]
            full = r.prompt_len // bs
            hit = pool.longest_hit(r.hashes[:full],
                                   prefix_hash.cacheable_blocks(r.prompt_len, bs))
            now_blocks, later, extra = self.blocks_needed(r.prompt_len, r.max_tokens, r.n)
            revived = sum(1 for b in hit if b.ref_cnt == 0)
            if pool.num_free - self.reserved < revived + now_blocks - len(hit) + later + extra:
                break  # first come, first served: the head waits for blocks
            self.waiting.popleft()
            pool.touch(hit)
            r.blocks = hit + pool.allocate(now_blocks - len(hit))
            r.extra_blocks = pool.allocate(extra)
            r.reserved = later
            self.reserved += later
            k = len(hit)
            self._cache_upto(r, k, full)
            r.cached_tokens = k * bs
            r.created_cache_tokens = (full - k) * bs
            self.prefix_cache_queries += r.prompt_len
            self.prefix_cache_hits += r.cached_tokens
            r.scheduled_at = self.loop.time()
            start = max(self.loop.time(), self.prefill_free_at)
            self.prefill_free_at = start + (r.prompt_len - k * bs) / s.prefill_tokens_per_s
            r.first_token_at = self.prefill_free_at + s.ttft_overhead_ms / 1000.0
            self.running.add(r)
            self.loop.call_at(r.first_token_at, self._first_token, r)
        self._events_changed()

    def _cache_upto(self, r: SimRequest, start: int, end: int) -> None:
        """Cache ``r``'s blocks ``start`` .. ``end`` - 1 (now full) under their hashes."""
        if end <= start:
            return
        bs, p = self.s.block_size, r.prompt_len
        lo, hi = start * bs, end * bs
        ids = r.prompt_ids[lo:min(hi, p)]
        if hi > p:
            ids = ids + [self.output_token_id] * (hi - max(lo, p))
        self.pool.cache(r.blocks[start:end], r.hashes[start:end],
                        r.hashes[start - 1] if start else None, ids,
                        r.salt if start == 0 else None)
        r.num_cached_blocks = end

    def itl_s(self) -> float:
        """The inter-token latency now (s), from the number of running requests."""
        return self.s.itl_ms / 1000.0 * (1.0 + self.s.itl_growth * max(len(self.running) - 1, 0))

    def _first_token(self, r: SimRequest) -> None:
        if r.finished:
            return
        r.generated = 1
        r.last_token_at = self.loop.time()
        # vLLM counts the prompt at each engine request's first output: once per choice
        self.prompt_tokens += r.prompt_len * r.n
        self.generation_tokens += r.n
        if self.on_ttft is not None:
            self.on_ttft(self.loop.time() - r.arrival)
        self._notify(r)
        if r.generated >= r.max_tokens:
            self._finish(r, "length")
            return
        r.next_at = r.first_token_at + self.itl_s()
        self._seq += 1
        heapq.heappush(self._decode, (r.next_at, self._seq, r))
        self._arm()

    def _arm(self) -> None:
        if not self._decode:
            return
        t = self._decode[0][0]
        if t < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(t, self._tick)
            self._timer_at = t

    def _tick(self) -> None:
        """One decode step for every request whose next token is due (within 0.5 ms)."""
        self._timer, self._timer_at = None, math.inf
        horizon = self.loop.time() + 0.0005
        itl = self.itl_s()
        heap = self._decode
        while heap and heap[0][0] <= horizon:
            _, _, r = heapq.heappop(heap)
            if r.finished:
                continue
            self._advance(r)
            if not r.finished:
                # the request keeps its own phase; a loop that fell behind catches up
                r.next_at += itl
                self._seq += 1
                heapq.heappush(heap, (r.next_at, self._seq, r))
        self._events_changed()
        self._arm()

    def _advance(self, r: SimRequest) -> None:
        r.generated += 1
        r.last_token_at = self.loop.time()
        self.generation_tokens += r.n
        bs = self.s.block_size
        computed = r.prompt_len + r.generated - 1   # tokens whose KV now exists
        if len(r.blocks) * bs < computed:
            r.blocks += self.pool.allocate(1)
            r.reserved -= 1
            self.reserved -= 1
        self._cache_upto(r, r.num_cached_blocks, computed // bs)
        self._notify(r)
        if r.generated >= r.max_tokens:
            self._finish(r, "length")

    def _finish(self, r: SimRequest, reason: str) -> None:
        r.finish_reason = reason
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.running.discard(r)
        self.reserved -= r.reserved
        r.reserved = 0
        self.pool.release(r.blocks)
        self.pool.release(r.extra_blocks)
        if self.on_finish is not None:
            self.on_finish(r)
        if not r.done.done():
            r.done.set_result(None)
        self._notify(r)
        self._schedule()

    @staticmethod
    def _notify(r: SimRequest) -> None:
        w = r.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- KV events ----------------------------------------------------------------------

    def _events_changed(self) -> None:
        """Publish what changed as one batch once the current callbacks are done (one
        scheduling step: vLLM publishes one batch per engine step)."""
        if not self.pool.events:
            return
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        events = self.pool.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)


def engine_records(r: SimRequest, model: str, now: float) -> list[dict[str, Any]]:
    """The engine usage records of a finished ``r`` (one per choice, ``index`` 0..n-1),
    with the fields tokengate's vLLM plugin gives them (``tokengate_vllm.record``:
    ``from_finished`` for a request that ran to its end, source "stats";
    ``from_aborted`` for one the client left, source "abort"). ``now``: the event
    loop's time of the finish (s); wall-clock times are taken now."""
    e2e = max(0.0, now - r.arrival)
    wall = time.time()
    first = r.generated >= 1   # the engine returned output: its prompt was counted
    sched = r.scheduled_at
    base = {
        "request_id": r.request_id, "n": r.n,
        "ts": engine_record.rfc3339(wall), "arrival_ts": engine_record.rfc3339(wall - e2e),
        "model": model, "key_id": r.key_endpoint[0], "endpoint": r.key_endpoint[1],
        "finish_reason": r.finish_reason,
        "source": "abort" if r.finish_reason == "abort" else "stats",
        "num_prompt_tokens": r.prompt_len, "num_generation_tokens": r.generated,
        "num_cached_tokens": r.cached_tokens, "prefilled": first,
        "max_tokens": r.max_tokens_param, "num_preemptions": 0,  # nothing is preempted
        "e2e_ms": engine_record.ms(e2e) or 0.0,
        "queued_ms": None if sched is None else engine_record.ms(sched - r.arrival),
        "prefill_ms": engine_record.ms(r.first_token_at - sched)
        if first and sched is not None else None,
        "decode_ms": engine_record.ms(r.last_token_at - r.first_token_at) if first else None,
    }
    return [{**base, "index": i} for i in range(r.n)]


# -- HTTP -------------------------------------------------------------------------------


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
            self.engine = Engine(s, self.renderer.output_token_id, self.publisher,
                                 self.ttft.observe,
                                 self._write_records if self.records is not None else None)
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
                              rid if kind == "chat" else f"{rid}-0", asked, edge.current())
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
    print(f"simulated vLLM replica on http://{host}:{port}/v1 (model {s.model}, "
          f"{s.num_gpu_blocks} blocks of {s.block_size} tokens, prefill "
          f"{s.prefill_tokens_per_s:g} tokens/s, ITL {s.itl_ms:g} ms"
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
