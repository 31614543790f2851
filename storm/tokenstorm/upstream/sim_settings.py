"""The settings of a simulated vLLM replica (``tokenstorm sim-replica``, whose rules
``tokenstorm.upstream.sim`` describes): one dataclass, the command's flags that give it,
and the flags it gives back for a child process."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tokengate import prefix_hash


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
