"""The settings of a simulated vLLM replica (``tokenstorm sim-replica``, whose rules
``tokenstorm.upstream.sim`` describes): one dataclass, the command's flags that give it,
and the flags it gives back for a child process."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from tokengate import prefix_hash

from tokenstorm.upstream.roofline import GPUS, ModelShape, Roofline

# vLLM 0.32's --scheduling-policy values (vllm/config/scheduler.py, SchedulerPolicy)
SCHEDULING_POLICIES = ("fcfs", "priority")


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
    ``TOKENGATE_ENGINE_USAGE_FILE`` with the plugin; None: none are written);
    ``scheduling_policy``: vLLM's ``--scheduling-policy``, ``fcfs`` or ``priority``
    (waiting requests by the body's ``priority``, then arrival; with ``gpu``, preemption
    of the lowest priority: ``tokenstorm.upstream.sim_priority``); ``spare_chunk``:
    above 0, under ``priority`` with ``gpu``, the rules of tokengate's vLLM plugin
    scheduler for requests of priority 1 or above, prefill chunks of this many tokens
    (``TOKENGATE_SCHED_SPARE_CHUNK``; ``sim_steps``), 0: vLLM's policy alone.
    ``gpu``: None for the fixed timing above, or a GPU of ``roofline.GPUS`` (``h100``,
    ``h200``): the engine then steps as vLLM's scheduler (``sim_steps``) with a token
    budget of ``max_num_batched_tokens`` per step, each step timed by the roofline of
    ``model_config`` (a shipped shape or a ``config.json``) on that GPU plus
    ``step_overhead_ms``; ``gpu_tflops`` / ``gpu_hbm_tb_s`` override its peak figures;
    ``num_gpu_blocks`` 0 then sizes the KV cache from the GPU's memory (90 %).

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
    gpu: str | None = None
    model_config: str = "qwen3-8b"
    max_num_batched_tokens: int = 8192
    step_overhead_ms: float = 2.0
    gpu_tflops: float | None = None
    gpu_hbm_tb_s: float | None = None
    scheduling_policy: str = "fcfs"
    spare_chunk: int = 0

    def roofline(self) -> Roofline | None:
        """The step timing of ``gpu`` (None: fixed timing); ValueError for an unknown
        GPU or model shape."""
        if self.gpu is None:
            return None
        if self.gpu not in GPUS:
            raise ValueError(f"--gpu {self.gpu!r}: one of {', '.join(GPUS)}")
        g = GPUS[self.gpu]
        g = replace(g, flops=g.flops if self.gpu_tflops is None else self.gpu_tflops * 1e12,
                    bandwidth=g.bandwidth if self.gpu_hbm_tb_s is None
                    else self.gpu_hbm_tb_s * 1e12)
        return Roofline(ModelShape.named(self.model_config), g,
                        self.step_overhead_ms / 1000.0)

    def sized(self) -> SimSettings:
        """These settings with ``num_gpu_blocks`` 0 replaced by what the GPU holds."""
        r = self.roofline()
        if r is None or self.num_gpu_blocks:
            return self
        return replace(self, num_gpu_blocks=r.kv_blocks(self.block_size) + 1)

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
        if self.max_num_batched_tokens < 1 or self.step_overhead_ms < 0:
            raise ValueError("--max-num-batched-tokens must be >= 1, --step-overhead-ms >= 0")
        self.roofline()
        if self.tokenizer not in ("hf", "counter"):
            raise ValueError("--tokenizer: hf or counter")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError("--scheduling-policy: fcfs or priority")
        if self.spare_chunk < 0 or (self.spare_chunk and (
                self.scheduling_policy != "priority" or self.gpu is None)):
            raise ValueError("--spare-chunk: >= 0, and above 0 only with --gpu and "
                             "--scheduling-policy priority")
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
               "--tokenizer", self.tokenizer,
               "--scheduling-policy", self.scheduling_policy]
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
        if self.gpu is not None:
            out += ["--gpu", self.gpu, "--model-config", self.model_config,
                    "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                    "--step-overhead-ms", repr(self.step_overhead_ms)]
            if self.gpu_tflops is not None:
                out += ["--gpu-tflops", repr(self.gpu_tflops)]
            if self.gpu_hbm_tb_s is not None:
                out += ["--gpu-hbm-tb-s", repr(self.gpu_hbm_tb_s)]
            if self.spare_chunk:
                out += ["--spare-chunk", str(self.spare_chunk)]
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
                   help="KV-cache blocks, vLLM's --num-gpu-blocks-override; 0 with "
                        "--gpu: what the GPU holds beside the weights (default: "
                        "%(default)s)")
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
    t.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   default=d.scheduling_policy,
                   help="vLLM's: fcfs, or priority (waiting requests by the body's "
                        "priority, lower first, then arrival; with --gpu, the lowest "
                        "priority running request is preempted when KV blocks run out) "
                        "(default: %(default)s)")
    t.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
                   metavar="TOKENS_PER_S",
                   help="prefill speed for uncached prompt tokens (default: %(default)s)")
    t.add_argument("--ttft-overhead-ms", type=float, default=d.ttft_overhead_ms, metavar="MS",
                   help="added to every TTFT (default: %(default)s)")
    t.add_argument("--itl-ms", type=float, default=d.itl_ms, metavar="MS",
                   help="inter-token latency with one request running (default: %(default)s)")
    t.add_argument("--itl-growth", type=float, default=d.itl_growth, metavar="X",
                   help="ITL x (1 + X x (running - 1)) (default: %(default)s)")
    r = p.add_argument_group("GPU timing (instead of the fixed timing above)")
    r.add_argument("--gpu", choices=tuple(GPUS), default=None,
                   help="step as vLLM's scheduler and time each step by a roofline of "
                        "--model-config on this GPU (default: fixed timing)")
    r.add_argument("--model-config", default=d.model_config, metavar="SHAPE|FILE",
                   help="the model whose FLOPs and bytes are counted: a shipped shape "
                        "(qwen3-8b, qwen3-14b, llama-3-8b) or a config.json "
                        "(default: %(default)s)")
    r.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   metavar="TOKENS", help="token budget per step, vLLM's flag "
                   "(default: %(default)s, vLLM's API server on an H100)")
    r.add_argument("--step-overhead-ms", type=float, default=d.step_overhead_ms,
                   metavar="MS", help="fixed time per step (default: %(default)s)")
    r.add_argument("--gpu-tflops", type=float, default=None, metavar="TFLOPS",
                   help="dense bf16 peak instead of the GPU's (h100, h200: 790)")
    r.add_argument("--gpu-hbm-tb-s", type=float, default=None, metavar="TB_S",
                   help="memory bandwidth instead of the GPU's (h100: 3.0, h200: 4.3)")
    r.add_argument("--spare-chunk", type=int, default=d.spare_chunk, metavar="TOKENS",
                   help="with --scheduling-policy priority: the rules of tokengate's vLLM "
                        "plugin scheduler for priority >= 1 (a waiting request preempts "
                        "one for a seat; their prefill never beside another's, in chunks "
                        "of TOKENS); 0: vLLM's policy alone (default: %(default)s)")


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
        engine_usage_file=args.engine_usage_file, gpu=args.gpu,
        model_config=args.model_config, max_num_batched_tokens=args.max_num_batched_tokens,
        step_overhead_ms=args.step_overhead_ms, gpu_tflops=args.gpu_tflops,
        gpu_hbm_tb_s=args.gpu_hbm_tb_s, scheduling_policy=args.scheduling_policy,
        spare_chunk=args.spare_chunk).sized()
