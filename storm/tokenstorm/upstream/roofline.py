"""The time of one engine step of a transformer on a GPU, by a roofline: the FLOPs and
the bytes a step moves, from the model's ``config.json``, against the GPU's peak
figures, plus a fixed step overhead (``tokenstorm sim-replica --gpu``).

A step of vLLM's scheduler runs one forward pass over a batch that mixes prefill chunks
and decodes (``vllm/v1/core/sched/scheduler.py``). Each part of the pass is as fast as
the slower of its arithmetic and its memory traffic (Williams, Waterman and Patterson,
"Roofline", CACM 2009), and the parts run one after another:

- **linear layers** (QKV, output projection, gated MLP, per layer): 2 FLOPs per weight
  per token scheduled; their weights read once per step (bf16: 2 bytes each);
- **attention** (per layer, per request): QK^T and PV over the cached context and the
  new tokens, causal within the new ones: 4 x heads x head_dim FLOPs per (query, key)
  pair; the K and V of the whole context read and those of the new tokens written;
- **LM head**: only at the positions that sample a token (vLLM computes logits for the
  last scheduled token of each request): 2 x hidden x vocab FLOPs each, its weights
  read once (unless tied to the embeddings, which a step reads only row by row);
- **overhead**: a fixed time per step (scheduling, sampling, kernel launches that CUDA
  graphs do not hide).

Peak figures default to an H100 SXM as measured on one (dense bf16 matrix products
about 790 TFLOP/s, device copies about 3.0 TB/s); an H200 has the same compute and about
4.3 TB/s. ``PUBLISHED`` holds vLLM measurements this model is checked against
(``check``; ``tokenstorm roofline-check`` prints it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHAPES_DIR = Path(__file__).with_name("shapes")


@dataclass(frozen=True)
class ModelShape:
    """What a step's cost depends on, from a Hugging Face ``config.json``.

    ``layers`` (num_hidden_layers), ``hidden`` (hidden_size), ``heads``
    (num_attention_heads), ``kv_heads`` (num_key_value_heads), ``head_dim`` (head_dim,
    or hidden / heads), ``intermediate`` (intermediate_size, gated MLP), ``vocab``
    (vocab_size), ``tied`` (tie_word_embeddings), ``dtype_bytes`` (2: bf16)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, path: Path, name: str | None = None) -> ModelShape:
        """The shape of ``path`` (a ``config.json``, or a folder holding one);
        ValueError naming a missing field."""
        if path.is_dir():
            path = path / "config.json"
        c = json.loads(path.read_text(encoding="utf-8"))
        try:
            heads = int(c["num_attention_heads"])
            return cls(name=name or str(c.get("_name_or_path") or path.parent.name),
                       layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]),
                       heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
                       head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                       intermediate=int(c["intermediate_size"]),
                       vocab=int(c["vocab_size"]),
                       tied=bool(c.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise ValueError(f"{path}: no {e.args[0]}") from None

    @classmethod
    def named(cls, name_or_path: str) -> ModelShape:
        """A shape shipped in ``shapes/`` (``qwen3-8b``, ``qwen3-14b``,
        ``llama-3-8b``) or a ``config.json`` path; ValueError when neither."""
        shipped = SHAPES_DIR / f"{name_or_path}.json"
        if shipped.is_file():
            return cls.from_config(shipped, name_or_path)
        p = Path(name_or_path)
        if p.exists():
            return cls.from_config(p)
        known = ", ".join(sorted(x.stem for x in SHAPES_DIR.glob("*.json")))
        raise ValueError(f"--model-config {name_or_path!r}: no such file; shipped: {known}")

    @property
    def linear_params(self) -> int:
        """Weights of the per-layer matrix products, all layers."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.layers * (self.hidden * (q + 2 * kv) + q * self.hidden
                              + 3 * self.hidden * self.intermediate)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (embeddings and LM head included)."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.linear_params + emb) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Gpu:
    """Peak figures of one GPU: ``flops`` (dense bf16 FLOP/s), ``bandwidth`` (HBM
    bytes/s), ``memory`` (bytes)."""

    name: str
    flops: float
    bandwidth: float
    memory: float


# Measured on the GPUs (matrix products and device copies; tokengate's design notes, §3)
GPUS = {
    "h100": Gpu("h100", 790e12, 3.0e12, 80e9),
    "h200": Gpu("h200", 790e12, 4.3e12, 141e9),
}


@dataclass(frozen=True)
class Roofline:
    """``step_s`` of one engine step for ``shape`` on ``gpu``, plus ``overhead_s``."""

    shape: ModelShape
    gpu: Gpu
    overhead_s: float = 0.002

    def step_s(self, parts: list[tuple[int, int, int]]) -> float:
        """Seconds of one step over ``parts``: (new tokens, tokens already cached, 1 when
        the part samples a token else 0) per request scheduled. 0 for no parts."""
        if not parts:
            return 0.0
        m, g = self.shape, self.gpu
        tokens = sum(p[0] for p in parts)
        sampled = sum(p[2] for p in parts)
        linear = max(2.0 * m.linear_params * tokens / g.flops,
                     m.linear_params * m.dtype_bytes / g.bandwidth)
        pairs = 0
        kv_tokens = 0
        for new, cached, _ in parts:
            pairs += new * cached + new * (new + 1) // 2
            kv_tokens += cached + 2 * new  # read all context, write the new
        attn = max(4.0 * m.layers * m.heads * m.head_dim * pairs / g.flops,
                   kv_tokens * m.kv_bytes_per_token / g.bandwidth)
        head = 0.0
        if sampled:
            head = max(2.0 * m.hidden * m.vocab * sampled / g.flops,
                       m.hidden * m.vocab * m.dtype_bytes / g.bandwidth)
        return linear + attn + head + self.overhead_s

    def kv_blocks(self, block_size: int, utilization: float = 0.9) -> int:
        """KV-cache blocks the GPU holds beside the weights at vLLM's
        ``--gpu-memory-utilization`` (activations ignored); ValueError when the weights
        do not fit."""
        room = self.gpu.memory * utilization - self.shape.weight_bytes
        if room <= 0:
            raise ValueError(f"{self.shape.name} ({self.shape.weight_bytes / 1e9:.1f} GB) "
                             f"does not fit one {self.gpu.name}")
        return int(room // (self.shape.kv_bytes_per_token * block_size))


@dataclass(frozen=True)
class Published:
    """One published vLLM measurement: ``what`` is measured (``tpot_ms``: mean time
    per output token at ``batch`` requests decoding, ``e2e_ms``: a batch of ``batch``
    requests of ``prompt`` tokens generating ``output`` tokens, all at once), ``value``
    in ms, ``source`` (address), ``note``."""

    model: str
    gpu: str
    what: str
    batch: int
    prompt: int
    output: int
    value: float
    source: str
    note: str


PUBLISHED = [
    Published("llama-3-8b", "h100", "tpot_ms", 1, 256, 128, 6.48,
              "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/",
              "vLLM 0.21, Llama-3.1-8B-Instruct, H100-80GB-HBM3, concurrency 1, TPOT p50 "
              "(chatbot-short prompts; 256 tokens assumed)"),
    Published("llama-3-8b", "h100", "tpot_ms", 4, 256, 128, 6.59,
              "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/",
              "same sweep, concurrency 4"),
    Published("llama-3-8b", "h100", "e2e_ms", 8, 32, 128, 997.5,
              "https://buildkite.com/elastic/enterprise-search-ruby/builds/571",
              "vLLM's nightly latency test latency_llama8B_tp1 (Meta-Llama-3-8B, tp 1, "
              "batch 8, 32 in, 128 out), 8xH100 runner, mean"),
    Published("llama-3-8b", "h200", "e2e_ms", 8, 32, 128, 833.4,
              "https://buildkite.com/vllm/performance-benchmark/builds/9515",
              "the same test on the H200 runner, mean"),
]


def predict(p: Published, overhead_s: float = 0.002) -> float:
    """What the roofline gives for ``p`` (ms), stepping as vLLM's scheduler does for
    requests that all arrive at once: one step prefills every prompt (it fits the
    token budget) and samples their first tokens, then one decode step per token."""
    r = Roofline(ModelShape.named(p.model), GPUS[p.gpu], overhead_s)
    if p.what == "tpot_ms":
        # the middle of the output: the context is the prompt plus half of it
        ctx = p.prompt + p.output // 2
        return 1000.0 * r.step_s([(1, ctx, 1)] * p.batch)
    total = r.step_s([(p.prompt, 0, 1)] * p.batch)
    for i in range(1, p.output):
        total += r.step_s([(1, p.prompt + i - 1, 1)] * p.batch)
    return 1000.0 * total


def check(overhead_s: float = 0.002) -> list[tuple[Published, float, float]]:
    """(measurement, prediction ms, relative error) for each of ``PUBLISHED``."""
    out = []
    for p in PUBLISHED:
        pred = predict(p, overhead_s)
        out.append((p, pred, pred / p.value - 1.0))
    return out


def decode_batch(r: Roofline, context: int, tpot_s: float, max_num_seqs: int = 1024,
                 kv_tokens: int | None = None) -> int:
    """The most requests at ``context`` tokens one replica can decode together with a
    step (one token each) within ``tpot_s``, at most ``max_num_seqs`` and what the KV
    cache holds (``kv_tokens``; default: what ``kv_blocks`` gives, blocks of 16); 0 when
    not even one meets ``tpot_s``."""
    room = kv_tokens if kv_tokens is not None else r.kv_blocks(16) * 16
    hi = min(max_num_seqs, room // max(context, 1))
    lo = 0
    while lo < hi:   # step_s grows with the batch: the largest batch within tpot_s
        mid = (lo + hi + 1) // 2
        if r.step_s([(1, context, 1)] * mid) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def request_s(r: Roofline, prompt: int, cached: int, output: int, tpot_s: float) -> float:
    """GPU seconds one request costs a replica kept busy within ``tpot_s``: the prefill of
    its ``prompt - cached`` uncached tokens (one step's work without the overhead) and
    its ``output`` tokens' share of decode steps of the largest batch within ``tpot_s``
    (``decode_batch`` at the middle of its output); inf when no batch meets ``tpot_s``."""
    uncached = max(prompt - cached, 1)
    prefill = r.step_s([(uncached, cached, 1)]) - r.overhead_s
    ctx = prompt + output // 2
    b = decode_batch(r, ctx, tpot_s)
    if b == 0:
        return float("inf")
    return prefill + output * r.step_s([(1, ctx, 1)] * b) / b


def replicas_needed(r: Roofline, rate: float, prompt: int, cached: int, output: int,
                    tpot_s: float, utilization: float = 0.8) -> tuple[int, float]:
    """(replicas, requests/s one replica serves) for ``rate`` requests/s of one shape
    within ``tpot_s``, each replica kept at most ``utilization`` busy (the rest absorbs
    bursts and keeps TTFT short: queueing grows without bound as it nears 1)."""
    per = 1.0 / request_s(r, prompt, cached, output, tpot_s)
    if per <= 0:
        raise ValueError(f"no batch of {r.shape.name} on {r.gpu.name} decodes within "
                         f"{tpot_s * 1000:g} ms a token")
    return max(1, int(-(-rate // (per * utilization)))), per
