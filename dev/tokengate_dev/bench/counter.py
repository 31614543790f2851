"""make bench-counter: the counter against HF ``tokenizers`` and raw tiktoken, one run.

For two workloads it measures prompt tokens per second of

  (a) HF ``tokenizers`` ``encode`` of the rendered prompt (what an exact counter
      without our fast path spends: the reference),
  (b) raw tiktoken ``encode`` of the same rendered prompt (a lower bound on tokenizing
      cost, no rendering, no RPC),
  (c) ``CountTokens`` over gRPC end to end (JSON parse, validation, chat template,
      counting, protobuf, a real ``tokengate-counter`` with 2 worker processes, 16
      requests in flight from a grpc.aio client),

and prints (c)/(a). Both cores serve (c) *and* run its Python client, so the bench also
reports (c) per CPU-second of the counter workers (what the counter costs behind the C
nginx edge) against (a), which runs on one core. Workloads: "cold" chat prompts of ~1,000 tokens with unique text
(nothing cached), and "conversation": 150 conversations of 10 turns, each turn sent with
the whole history (as chat clients do), so the counter's segment cache sees the history
again and tokenizes only the new turn. Results: ``bench/results/counter.json``.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokengate import config as tg_config
from tokengate.counter.counting import ModelCounter

from tokengate_dev import devstack

WORDS = ["token", "gateway", "latency", "throughput", "prefix", "cache", "scheduler", "reservation", "settlement", "模型", "推理", "缓存", "日本語", "한국어", "emoji", "😀", "code", "def", "return", "{}", "[]", "()", "123", "4.56", "naïve", "café", "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "I", "this", "are", "or", "his"]
BENCH_PORT = 50151


@dataclass
class Row:
    workload: str
    requests: int
    prompt_tokens: int
    hf_tokens_per_s: float
    tiktoken_tokens_per_s: float
    counter_tokens_per_s: float
    counter_tokens_per_cpu_s: float

    @property
    def ratio_per_core(self) -> float:
        return self.counter_tokens_per_cpu_s / self.hf_tokens_per_s

    @property
    def ratio(self) -> float:
        return self.counter_tokens_per_s / self.hf_tokens_per_s


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + (str(rng.randrange(10_000)) if rng.random() < 0.1
                                         else "") for _ in range(words))


def cold_bodies(n: int, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"model": "tiny-qwen3", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _text(rng, 560)}]} for _ in range(n)]


def conversation_bodies(conversations: int, turns: int = 10, seed: int = 2) \
        -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        history: list[dict[str, str]] = [{"role": "system", "content": _text(rng, 60)}]
        for _ in range(turns):
            history.append({"role": "user", "content": _text(rng, 80)})
            out.append({"model": "tiny-qwen3", "messages": list(history)})
            history.append({"role": "assistant", "content": _text(rng, 120)})
    return out


async def _grpc_run(bodies: list[bytes], port: int, concurrency: int = 16) -> tuple[float, int]:
    import grpc
    from tokengate.v1 import counter_pb2, counter_pb2_grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = counter_pb2_grpc.TokenCounterStub(channel)
        queue = list(reversed(bodies))
        total = 0

        async def worker() -> None:
            nonlocal total
            while queue:
                body = queue.pop()
                r = await stub.CountTokens(counter_pb2.CountRequest(
                    endpoint=counter_pb2.ENDPOINT_CHAT, body=body))
                total += r.prompt_tokens

        await stub.CountTokens(counter_pb2.CountRequest(endpoint=counter_pb2.ENDPOINT_CHAT,
                                                        body=bodies[0]))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, total


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the counter workers)."""
    import psutil

    proc = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


def measure(name: str, bodies: list[dict[str, Any]], mc: ModelCounter, port: int,
            server_pid: int) -> Row:
    assert mc.template is not None
    template, tok = mc.template, mc.tokenizer
    hf = tok.hf
    assert hf is not None
    texts = [template.render(b["messages"], None, {"add_generation_prompt": True})
             for b in bodies]
    start = time.perf_counter()
    hf_tokens = sum(len(hf.encode(t, add_special_tokens=False).ids) for t in texts)
    hf_s = time.perf_counter() - start
    import tiktoken
    from tokengate.counter.tokenizer import _encoding_from_spec
    enc: tiktoken.Encoding = _encoding_from_spec(
        json.loads((mc.model.dir / "tokenizer.json").read_text()), tok.added)
    start = time.perf_counter()
    tt_tokens = sum(len(enc.encode(t, allowed_special="all")) for t in texts)
    tt_s = time.perf_counter() - start
    raw = [json.dumps(b).encode() for b in bodies]
    cpu_before = _cpu_seconds(server_pid)
    grpc_s, grpc_tokens = asyncio.run(_grpc_run(raw, port))
    server_cpu_s = _cpu_seconds(server_pid) - cpu_before
    if hf_tokens != grpc_tokens:
        raise SystemExit(f"{name}: counter says {grpc_tokens} tokens, HF {hf_tokens}")
    return Row(name, len(bodies), hf_tokens, hf_tokens / hf_s, tt_tokens / tt_s,
               grpc_tokens / grpc_s, grpc_tokens / server_cpu_s)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml")
    model = cfg.models["tiny-qwen3"]
    mc = ModelCounter.load(model)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "tokengate.yaml"
        cfg_path.write_text((devstack.ROOT / "tokengate.yaml").read_text().replace(
            "dir: var/models/", f"dir: {devstack.ROOT}/var/models/"))
        console.print("starting tokengate-counter (2 workers) ...")
        svc = devstack.counter_service(cfg_path, port=BENCH_PORT, workers=2,
                                       name="bench-counter").start()
        assert svc.proc is not None
        pid = svc.proc.pid
        try:
            rows = []
            console.print("cold 1k-token prompts ...")
            rows.append(measure("cold 1k-token prompts", cold_bodies(2000), mc,
                                BENCH_PORT, pid))
            console.print("10-turn conversations ...")
            rows.append(measure("10-turn conversations",
                                conversation_bodies(150), mc, BENCH_PORT, pid))
        finally:
            svc.stop()
    table = Table(title="prompt tokens per second: (a) HF tokenizers encode, (b) raw tiktoken, "
                        "(c) CountTokens over gRPC; per core = (c) per counter CPU-second / (a)")
    for col in ("workload", "requests", "tokens", "(a) HF", "(b) tiktoken", "(c) gRPC",
                "(c)/(a)", "(c)/counter CPU-s", "per core"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(r.workload, str(r.requests), f"{r.prompt_tokens:,}",
                      f"{r.hf_tokens_per_s:,.0f}", f"{r.tiktoken_tokens_per_s:,.0f}",
                      f"{r.counter_tokens_per_s:,.0f}", f"{r.ratio:.2f}x",
                      f"{r.counter_tokens_per_cpu_s:,.0f}", f"{r.ratio_per_core:.2f}x")
    console.print(table)
    out = devstack.ROOT / "bench" / "results" / "counter.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{**asdict(r), "ratio_c_over_a": r.ratio,
                                "ratio_per_core_c_over_a": r.ratio_per_core} for r in rows],
                              indent=2))
    console.print(f"results: {out.relative_to(devstack.ROOT)}")


if __name__ == "__main__":
    main()
