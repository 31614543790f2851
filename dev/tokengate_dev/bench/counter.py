"""make bench-counter: the counter against raw tiktoken and HF ``tokenizers``, one run.

For two workloads, on the same rendered prompts, it measures

  (a) HF ``tokenizers`` ``encode`` (what an exact counter without the fast path spends),
      tokens per CPU-second of this process;
  (b) raw tiktoken ``encode`` (a lower bound on tokenizing cost: no JSON, no rendering,
      no RPC, no cache), tokens per CPU-second of this process (one core);
  (c) ``ModelCounter.count`` in this process on the parsed bodies (empty segment cache at
      the start, as a fresh server): the counter's Python path without gRPC;
  (d) ``CountTokens`` end to end against a real ``tokengate-counter`` (``--workers``,
      default 1; 16 requests in flight), per CPU-second of the counter's processes (what
      the counter costs behind the C nginx edge; the client's CPU is not counted): in
      counter frames on the workers' unix sockets (what the edge speaks,
      ``tokengate.counter.frames``), and over gRPC on TCP (what tools speak);
  (e) the same calls against a no-op counter (the counter's servers, a CountTokens that
      answers a constant): each transport's floor per call.

The aims (``AIMS``) are (d) / (b) in counter frames; the aims table also prints (c) /
(b), the same over gRPC and the ratio the frames' floor (e) allows at best, counting for
free. Workloads: "cold" chat prompts of ~1,000 tokens with unique text (nothing
cached), and "conversation": 150 conversations of 10 turns, each turn sent with the
whole history (as chat clients do), so the counter's segment cache sees the history
again and tokenizes only the new turn, and its template traces render each shape once.
Bodies are sent as the edge forwards them (raw UTF-8).

(b), (c) and (d) are paired (``BATCH``): batch by batch, one right after the other, on
one core. This machine's cores each drift in speed from second to second, so figures
taken apart swing by half, and the ratios with them; paired, the ratios held within a
tenth over five runs while the absolute figures still moved by a third.

One worker by default, on the core of (b) and (c), while this client sends from the
other core. With two workers on a 2-core machine three busy processes share two cores,
and each call's CPU time grows by about a half for that alone (measured: in-process
counting beside two busy processes went from 351-372 to 444-519 µs a call; the
conversations' ratio fell from 1.93x with one worker to 1.27x with two in back-to-back
runs). ``--workers 2`` measures that too (its workers are not pinned).
Results: ``bench/results/counter.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from rich.table import Table
from tokengate import config as tg_config
from tokengate import grpc_server
from tokengate.counter import frames
from tokengate.counter.counting import ModelCounter
from tokengate.counter.server import new_grpc_server
from tokengate.tools.nginx_conf import counter_sockets
from tokengate.v1 import counter_pb2, counter_pb2_grpc
from tokenstorm.null_server import free_port
from tokenstorm.process import Service, tcp_ready

from tokengate_dev import devstack

if TYPE_CHECKING:
    import tiktoken

WORDS = ["token", "gateway", "latency", "throughput", "prefix", "cache", "scheduler", "reservation", "settlement", "模型", "推理", "缓存", "日本語", "한국어", "emoji", "😀", "code", "def", "return", "{}", "[]", "()", "123", "4.56", "naïve", "café", "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "I", "this", "are", "or", "his"]


# Noise: on this 2-core machine each core's speed drifts on its own from second to second
# (raw tiktoken on the same texts: 212-372 µs a 1k-token prompt over 18 passes, either
# core faster at times), so figures taken seconds apart, or on the two cores, make ratios
# that swing by half. The aims' figures are paired instead: the bodies go in batches of
# BATCH, and each batch is tokenized by raw tiktoken, counted in this process and counted
# by the counter in frames, one right after the other, all three on the same core (the
# counter's worker and this process pinned there; this process sends the frames from the
# other core). PASSES passes, each with a fresh counter (an empty segment cache) in this
# process and in frames.
BATCH = 250
PASSES = 2
# The counter's aims, as (label, workload, target): tokens per counter
# CPU-second in counter frames / raw tiktoken's tokens per CPU-second on the same texts.
AIMS = [
    ("cold 1k-token prompts: counter / raw tiktoken, per CPU-second", "cold", 0.6),
    ("10-turn conversations: counter / raw tiktoken, per CPU-second", "conversation", 2.0),
]


@dataclass
class Row:
    """One workload's figures: tokens per CPU-second of HF ``tokenizers``, of raw
    tiktoken, of ``ModelCounter.count`` in this process and of the counter's workers in
    counter frames (and their tokens per second of wall time); the counter's and the
    no-op server's CPU per call in frames and over gRPC (µs)."""

    workload: str
    requests: int
    prompt_tokens: int
    hf_tokens_per_s: float
    tiktoken_tokens_per_cpu_s: float
    inprocess_tokens_per_cpu_s: float
    counter_tokens_per_s: float
    counter_tokens_per_cpu_s: float
    counter_cpu_us_per_call: float
    noop_cpu_us_per_call: float
    grpc_cpu_us_per_call: float
    noop_grpc_cpu_us_per_call: float

    @property
    def ratio(self) -> float:
        """The aims' figure: counter in counter frames / raw tiktoken, per CPU-second."""
        return self.counter_tokens_per_cpu_s / self.tiktoken_tokens_per_cpu_s

    @property
    def grpc_ratio(self) -> float:
        """The same over gRPC."""
        return self.counter_tokens_per_cpu_s * self.counter_cpu_us_per_call \
            / self.grpc_cpu_us_per_call / self.tiktoken_tokens_per_cpu_s

    @property
    def inprocess_ratio(self) -> float:
        return self.inprocess_tokens_per_cpu_s / self.tiktoken_tokens_per_cpu_s

    @property
    def floor_ratio(self) -> float:
        """The best ``ratio`` a counter could reach whose calls cost what the no-op
        server's do in counter frames (counting for free): the transport's floor."""
        tokens_per_call = self.prompt_tokens / self.requests
        return tokens_per_call / (self.noop_cpu_us_per_call * 1e-6) \
            / self.tiktoken_tokens_per_cpu_s


class _NoopCounter(counter_pb2_grpc.TokenCounterServicer):
    """CountTokens that answers a constant of a real reply's size: no JSON, no counting,
    no metrics."""

    REPLY = counter_pb2.CountReply(
        prompt_tokens=1000, max_model_len=4096, max_tokens_effective=16,
        max_tokens_requested=16, breakdown=counter_pb2.Breakdown(messages=990,
                                                                 template_overhead=10),
        tokenizer_fingerprint="0123456789abcdef-01234567", tokenizer_backend="tiktoken")

    def CountTokens(self, request: counter_pb2.CountRequest,
                    context: grpc.ServicerContext) -> counter_pb2.CountReply:
        return self.REPLY


def _serve_noop(listen: grpc_server.Listen, threads: int, index: int) -> None:
    """One no-op worker: the counter's own servers (``new_grpc_server`` on TCP, counter
    frames on the unix socket, as ``tokengate-counter`` serves them), answering
    ``_NoopCounter``'s constant."""
    server = new_grpc_server(threads)
    noop = _NoopCounter()
    counter_pb2_grpc.add_TokenCounterServicer_to_server(noop, server)
    name = counter_pb2.DESCRIPTOR.services_by_name["TokenCounter"].full_name
    asyncio.run(frames.serve(lambda request: noop.REPLY, listen, index, grace_s=1,
                             tcp_server=server, services=[name]))


def noop_service(port: int, sock: Path, workers: int) -> Service:
    """The no-op counter as a process: ``workers`` workers on 127.0.0.1:``port`` (gRPC)
    and ``<sock>.<i>`` (counter frames)."""
    argv = [devstack.PYTHON, "-m", "tokengate_dev.bench.counter", "--noop-server", str(port),
            "--noop-socket", str(sock), "--workers", str(workers)]
    return Service("bench-noop-counter", argv, tcp_ready("127.0.0.1", port), {}, 60.0,
                   cwd=devstack.ROOT, log_dir=devstack.VAR / "log")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + (str(rng.randrange(10_000)) if rng.random() < 0.1
                                         else "") for _ in range(words))


def cold_bodies(n: int, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"model": "tiny-qwen3", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _text(rng, 560)}]} for _ in range(n)]


def conversation_bodies(conversations: int, turns: int = 10, seed: int = 2,
                        words: tuple[int, int, int] = (60, 80, 120)) -> list[dict[str, Any]]:
    """Chat bodies of ``conversations`` conversations, ``turns`` each, in order: every
    turn the whole history as messages, a system message, then user and assistant
    turns; ``words``: the system's, each user turn's and each assistant turn's."""
    rng = random.Random(seed)
    system, user, assistant = words
    out = []
    for _ in range(conversations):
        history: list[dict[str, str]] = [{"role": "system", "content": _text(rng, system)}]
        for _ in range(turns):
            history.append({"role": "user", "content": _text(rng, user)})
            out.append({"model": "tiny-qwen3", "messages": list(history)})
            history.append({"role": "assistant", "content": _text(rng, assistant)})
    return out


def _requests(bodies: list[bytes]) -> list[counter_pb2.CountRequest]:
    return [counter_pb2.CountRequest(endpoint=counter_pb2.ENDPOINT_CHAT, body=b)
            for b in bodies]


async def _grpc_run(requests: list[counter_pb2.CountRequest], port: int,
                    concurrency: int = 16) -> tuple[float, int]:
    """(seconds, prompt tokens answered) of CountTokens for every request,
    ``concurrency`` in flight."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = counter_pb2_grpc.TokenCounterStub(channel)
        queue = list(reversed(requests))
        total = 0

        async def worker() -> None:
            nonlocal total
            while queue:
                r = await stub.CountTokens(queue.pop())
                total += r.prompt_tokens

        await stub.CountTokens(requests[0])
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, total


class _FramesClient(asyncio.Protocol):
    """One connection of ``_FramesPool``: sends the next request of the pool's queue when
    the previous one's reply is in (as an nginx worker's cosocket does), adds up the
    prompt tokens; sets its future when the queue is empty."""

    def __init__(self, queue: list[bytes]) -> None:
        self._queue = queue
        self._done: asyncio.Future[int] | None = None
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self.total = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def start(self, done: asyncio.Future[int]) -> None:
        """Send requests until the queue is empty; then ``done`` gets this connection's
        prompt tokens of this batch."""
        self._done, self.total = done, 0
        self._next()

    def _next(self) -> None:
        assert self._transport is not None and self._done is not None
        if self._queue:
            self._transport.write(self._queue.pop())
        elif not self._done.done():
            self._done.set_result(self.total)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        head = frames.REPLY_HEADER.size
        if len(buf) < head:
            return
        code, _, n = frames.REPLY_HEADER.unpack_from(buf)
        if len(buf) < head + n:
            return
        payload = bytes(buf[head:head + n])
        del buf[:head + n]
        assert self._done is not None
        if code != 0:
            self._done.set_exception(SystemExit(f"counter frames: status {code}: "
                                                f"{payload!r}"))
            return
        self.total += counter_pb2.CountReply.FromString(payload).prompt_tokens
        self._next()


class _FramesPool:
    """``concurrency`` connections in counter frames spread over the workers'
    ``sockets``, one call in flight on each, kept open from batch to batch. Requests are
    framed before a batch starts, so that the client takes as little of the 2 cores from
    the counter as it can."""

    def __init__(self, conns: Sequence[tuple[asyncio.BaseTransport, _FramesClient]],
                 queue: list[bytes]) -> None:
        self._conns, self._queue = conns, queue

    @classmethod
    async def connect(cls, sockets: list[Path], concurrency: int = 16) -> _FramesPool:
        loop = asyncio.get_running_loop()
        queue: list[bytes] = []
        conns = [await loop.create_unix_connection(functools.partial(_FramesClient, queue),
                                                   str(sockets[i % len(sockets)]))
                 for i in range(concurrency)]
        return cls(conns, queue)

    async def run(self, requests: list[bytes]) -> int:
        """Prompt tokens answered to ``requests`` (framed), sent in order."""
        loop = asyncio.get_running_loop()
        self._queue[:] = reversed(requests)
        done = [loop.create_future() for _ in self._conns]
        for (_, client), f in zip(self._conns, done, strict=True):
            client.start(f)
        return sum(await asyncio.gather(*done))

    def close(self) -> None:
        for transport, _ in self._conns:
            transport.close()


async def _frames_run(requests: list[counter_pb2.CountRequest], sockets: list[Path]
                      ) -> tuple[float, int]:
    """``_grpc_run`` in counter frames (``_FramesPool``)."""
    framed = [frames.framed(r.SerializeToString()) for r in requests]
    start = time.perf_counter()
    pool = await _FramesPool.connect(sockets)
    try:
        total = await pool.run(framed)
    finally:
        pool.close()
    return time.perf_counter() - start, total


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the counter workers)."""
    import psutil

    proc = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


@dataclass(frozen=True)
class Server:
    """A counter under test: its gRPC ``port``, its workers' frame ``sockets``, ``pid``."""

    port: int
    sockets: list[Path]
    pid: int


def _cpu_timed(work: Callable[[], int]) -> tuple[float, int]:
    """(CPU seconds of this process, result) of ``work()``: a token count."""
    start = time.process_time()
    tokens = work()
    return time.process_time() - start, tokens


def _cpu_per_call_us(bodies: list[bytes], server: Server, grpc_: bool = False
                     ) -> tuple[float, float, int]:
    """(server CPU µs per call, wall seconds, tokens answered) of ``bodies`` sent to
    ``server`` in counter frames (``grpc_``: over gRPC)."""
    requests = _requests(bodies)
    before = _cpu_seconds(server.pid)
    seconds, tokens = asyncio.run(_grpc_run(requests, server.port) if grpc_
                                  else _frames_run(requests, server.sockets))
    return (_cpu_seconds(server.pid) - before) / len(bodies) * 1e6, seconds, tokens


@dataclass
class _Paired:
    """CPU seconds and prompt tokens of ``_paired_pass``es: raw tiktoken's, the in-process
    counter's, the counter's in frames (its workers' CPU, and the client's wall time)."""

    tiktoken_s: float = 0.0
    tiktoken_tokens: int = 0
    inprocess_s: float = 0.0
    inprocess_tokens: int = 0
    frames_cpu_s: float = 0.0
    frames_wall_s: float = 0.0
    frames_tokens: int = 0


def _cores() -> tuple[int, int]:
    """(the core the paired figures are taken on, the core the frames client runs on):
    two cores of this process's affinity, or the same one twice."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[-1]


async def _paired_pass(texts: list[str], raw: list[bytes], enc: tiktoken.Encoding,
                       fresh: ModelCounter, server: Server, into: _Paired) -> None:
    """One pass over the bodies in batches of BATCH (see there): raw tiktoken ``enc`` on
    the batch's rendered ``texts``, ``fresh.count`` on its ``raw`` bodies, then the same
    bodies to ``server`` in counter frames; added to ``into``. With one worker, that
    worker and this process's tokenizing and counting run on one core, the frames
    client on the other (``_cores``)."""
    import psutil

    measured, client = _cores()
    everywhere = os.sched_getaffinity(0)
    if len(server.sockets) == 1:  # the worker's main thread counts; the others wait
        top = psutil.Process(server.pid)
        for proc in (top, *top.children(recursive=True)):
            proc.cpu_affinity([measured])
    def tokenized(texts: list[str]) -> int:
        return sum(len(enc.encode(t, allowed_special="all")) for t in texts)

    def counted(bodies: list[bytes]) -> int:
        return sum(fresh.count("chat", json.loads(b)).prompt_tokens for b in bodies)

    framed = [frames.framed(r.SerializeToString()) for r in _requests(raw)]
    pool = await _FramesPool.connect(server.sockets)
    try:
        for i in range(0, len(raw), BATCH):
            os.sched_setaffinity(0, {measured})
            s, n = _cpu_timed(functools.partial(tokenized, texts[i:i + BATCH]))
            into.tiktoken_s += s
            into.tiktoken_tokens += n
            s, n = _cpu_timed(functools.partial(counted, raw[i:i + BATCH]))
            into.inprocess_s += s
            into.inprocess_tokens += n
            os.sched_setaffinity(0, {client})
            cpu, start = _cpu_seconds(server.pid), time.perf_counter()
            into.frames_tokens += await pool.run(framed[i:i + BATCH])
            into.frames_wall_s += time.perf_counter() - start
            into.frames_cpu_s += _cpu_seconds(server.pid) - cpu
    finally:
        os.sched_setaffinity(0, everywhere)
        pool.close()


def measure(name: str, bodies: list[dict[str, Any]], mc: ModelCounter,
            fresh_counter: Callable[[], contextlib.AbstractContextManager[Server]],
            noop: Server) -> Row:
    """One workload's Row: HF once; raw tiktoken, the in-process counter and the counter
    in frames paired (``_paired_pass``, PASSES times); gRPC and the no-op counter once.
    ``fresh_counter()``: a real counter just started (an empty segment cache, as the
    in-process one)."""
    assert mc.template is not None
    template, tok = mc.template, mc.tokenizer
    hf = tok.hf
    assert hf is not None
    texts = [template.render(b["messages"], None, {"add_generation_prompt": True})
             for b in bodies]
    hf_s, hf_tokens = _cpu_timed(lambda: sum(len(hf.encode(t, add_special_tokens=False).ids)
                                             for t in texts))
    from tokengate.counter.tokenizer import _encoding_from_spec
    enc: tiktoken.Encoding = _encoding_from_spec(
        json.loads((mc.model.dir / "tokenizer.json").read_text()), tok.added)
    # as the edge forwards them: raw UTF-8, only '"', '\\' and controls escaped
    # (lua/tokengate/json.lua); with \u escapes json.loads took twice as long
    raw = [json.dumps(b, ensure_ascii=False).encode() for b in bodies]
    p = _Paired()
    for _ in range(PASSES):
        with fresh_counter() as counter:
            asyncio.run(_paired_pass(texts, raw, enc, ModelCounter.load(mc.model), counter, p))
    with fresh_counter() as counter:
        grpc_us, _, grpc_tokens = _cpu_per_call_us(raw, counter, grpc_=True)
    noop_us, _, _ = _cpu_per_call_us(raw, noop)
    noop_grpc_us, _, _ = _cpu_per_call_us(raw, noop, grpc_=True)
    counts = (p.tiktoken_tokens, p.inprocess_tokens, p.frames_tokens)
    if not all(n == hf_tokens * PASSES for n in counts) or grpc_tokens != hf_tokens:
        raise SystemExit(f"{name}: HF says {hf_tokens} tokens, over {PASSES} passes raw "
                         f"tiktoken, this process and the counter in frames {counts}, "
                         f"gRPC {grpc_tokens}")
    calls = len(bodies) * PASSES
    return Row(name, len(bodies), hf_tokens, hf_tokens / hf_s,
               p.tiktoken_tokens / p.tiktoken_s, p.inprocess_tokens / p.inprocess_s,
               p.frames_tokens / p.frames_wall_s, p.frames_tokens / p.frames_cpu_s,
               p.frames_cpu_s / calls * 1e6, noop_us, grpc_us, noop_grpc_us)


def render(rows: dict[str, Row]) -> tuple[Table, Table]:
    """The figures table and the aims table."""
    table = Table(title="prompt tokens per CPU-second (HF, raw tiktoken, in-process, "
                        "counter in frames) and per second (frames, wall); CPU µs per call "
                        "of the counter and of a no-op one, in counter frames and over gRPC",
                  header_style="bold")
    for col in ("workload", "requests", "tokens", "HF\ntokenizers", "raw\ntiktoken",
                "count()\nin-process", "frames\n(wall)", "counter CPU\n(frames)",
                "µs/call\nframes", "no-op\nframes", "µs/call\ngRPC", "no-op\ngRPC"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows.values():
        table.add_row(r.workload, str(r.requests), f"{r.prompt_tokens:,}",
                      f"{r.hf_tokens_per_s:,.0f}", f"{r.tiktoken_tokens_per_cpu_s:,.0f}",
                      f"{r.inprocess_tokens_per_cpu_s:,.0f} ({r.inprocess_ratio:.2f}x)",
                      f"{r.counter_tokens_per_s:,.0f}",
                      f"{r.counter_tokens_per_cpu_s:,.0f} ({r.ratio:.2f}x)",
                      f"{r.counter_cpu_us_per_call:,.0f}", f"{r.noop_cpu_us_per_call:,.0f}",
                      f"{r.grpc_cpu_us_per_call:,.0f}",
                      f"{r.noop_grpc_cpu_us_per_call:,.0f}")
    aims = Table(title="make bench-counter: aims vs measured (ratios to raw tiktoken per "
                       "CPU-second, the counter in frames as the edge calls it; floor: the "
                       "no-op counter's calls, counting for free)", header_style="bold")
    for c in ("aim", "measured", "target", "in-process", "over gRPC", "floor allows", ""):
        aims.add_column(c, justify="left" if c == "aim" else "right")
    for label, workload, target in AIMS:
        r = rows[workload]
        aims.add_row(label, f"{r.ratio:.2f}x", f">= {target:g}x", f"{r.inprocess_ratio:.2f}x",
                     f"{r.grpc_ratio:.2f}x", f"{r.floor_ratio:.2f}x",
                     "[green]met[/]" if r.ratio >= target else "[red]not met[/]")
    return table, aims


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokengate_dev.bench.counter",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1,
                   help="counter worker processes (default: %(default)s; see above)")
    p.add_argument("--noop-server", type=int, default=None, metavar="PORT",
                   help="serve the no-op counter on PORT (what the bench starts)")
    p.add_argument("--noop-socket", default=None, metavar="PATH",
                   help="with --noop-server: its counter frames on PATH.<i>")
    a = p.parse_args(argv)
    if a.noop_server is not None:
        grpc_server.run_workers("noop-counter", _serve_noop,
                                (grpc_server.Listen((f"127.0.0.1:{a.noop_server}",),
                                                    a.noop_socket), 1), a.workers)
        return
    from rich.console import Console

    console = Console(width=170)
    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml")
    model = cfg.models["tiny-qwen3"]
    mc = ModelCounter.load(model)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "tokengate.yaml"
        cfg_path.write_text((devstack.ROOT / "tokengate.yaml").read_text().replace(
            "dir: var/models/", f"dir: {devstack.ROOT}/var/models/"))

        def sockets(base: Path) -> list[Path]:
            return counter_sockets(base, a.workers)

        @contextlib.contextmanager
        def fresh_counter() -> Iterator[Server]:
            port, sock = free_port(), Path(tmp) / "counter.sock"
            svc = devstack.counter_service(cfg_path, port=port, unix_socket=sock,
                                           workers=a.workers, name="bench-counter",
                                           metrics_listen=f"127.0.0.1:{free_port()}").start()
            try:
                assert svc.proc is not None
                _wait_for(sockets(sock))
                yield Server(port, sockets(sock), svc.proc.pid)
            finally:
                svc.stop()

        console.print(f"tokengate-counter ({a.workers} workers, started afresh for each "
                      "transport) and a no-op counter ...")
        noop_port, noop_sock = free_port(), Path(tmp) / "noop.sock"
        noop = noop_service(noop_port, noop_sock, a.workers).start()
        assert noop.proc is not None
        try:
            _wait_for(sockets(noop_sock))
            ends = fresh_counter, Server(noop_port, sockets(noop_sock), noop.proc.pid)
            rows = {}
            console.print("cold 1k-token prompts ...")
            rows["cold"] = measure("cold 1k-token prompts", cold_bodies(2000), mc, *ends)
            console.print("10-turn conversations ...")
            rows["conversation"] = measure("10-turn conversations", conversation_bodies(150),
                                           mc, *ends)
        finally:
            noop.stop()
    for t in render(rows):
        console.print(t)
    out = devstack.ROOT / "bench" / "results" / "counter.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: {**asdict(r), "ratio_to_tiktoken": r.ratio,
                                   "grpc_ratio_to_tiktoken": r.grpc_ratio,
                                   "inprocess_ratio_to_tiktoken": r.inprocess_ratio,
                                   "floor_ratio_to_tiktoken": r.floor_ratio}
                               for k, r in rows.items()}, indent=2))
    console.print(f"results: {out.relative_to(devstack.ROOT)}")


def _wait_for(paths: list[Path], timeout_s: float = 60.0) -> None:
    """Until every worker published its socket (the TCP port answers before the last
    worker has loaded its model)."""
    deadline = time.monotonic() + timeout_s
    while not all(p.is_socket() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"the counter's sockets did not appear: {paths}")
        time.sleep(0.1)


if __name__ == "__main__":
    main()
