"""The simulated vLLM replica (``tokenstorm sim-replica``) against a real vLLM CPU server
with prefix caching and KV events on (blocks of 32 tokens, the smallest vLLM's CPU
attention takes, and 40 of them, as the simulated one is given): the same requests, in the same order, must give the same KV
events (field for field as they travel, tests/kv_events_wire.py), the same ``cached_tokens``, the
same evictions and the same ``prompt_tokens``; and the protocol of the fast upstream's
contract. Then what only the simulation can show cheaply: TTFT from the uncached
tokens, the waiting queue, a client that leaves, the replay socket.

Long for one thing: one replica model checked against vLLM and its own timing, with the
vLLM server started once for all the parity cases.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from tokengate import config as tg_config
from tokengate import prefix_hash
from tokengate.ledger.engine_record import EngineRecord, parse_record
from tokenstorm.process import free_port
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tests import kv_events_wire as kv_wire
from tests.conftest import MODEL, PORT_OFFSET
from tests.fixtures_vllm import VllmFactory, VllmServer
from tests.storm.test_upstream_contract import SUCCESS_CASES, assert_same_answer, call

BLOCK = 32                   # vLLM CPU: "No common block size for 16 (MultipleOf(32))"
NUM_BLOCKS = 40              # 39 usable: vLLM's block 0 is its null block
MAX_LEN = 512
KV_PORT = 18190 + PORT_OFFSET
TOPIC = "kv-events"
RNG = random.Random()        # prompts differ between runs: a shared vLLM holds no hits


def sim_settings(cfg: tg_config.Config, **kw: Any) -> SimSettings:
    m = cfg.models[MODEL]
    base: dict[str, Any] = {"model": m.name, "model_dir": Path(m.dir), "max_model_len": MAX_LEN,
                            "block_size": BLOCK, "num_gpu_blocks": NUM_BLOCKS,
                            "prefill_tokens_per_s": 1e6, "ttft_overhead_ms": 0.0,
                            "itl_ms": 1.0}
    base.update(kw)
    return SimSettings(**base)


@pytest.fixture(scope="module")
def kv_vllm(vllm_server: VllmFactory) -> VllmServer:
    """The real vLLM CPU server with KV events on tcp://*:KV_PORT, blocks of 32 tokens,
    40 blocks and /reset_prefix_cache (VLLM_SERVER_DEV_MODE)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{KV_PORT}", "topic": TOPIC}
    return vllm_server(extra_args=("--kv-events-config", json.dumps(config),
                                   "--block-size", str(BLOCK),
                                   "--num-gpu-blocks-override", str(NUM_BLOCKS),
                                   "--max-model-len", str(MAX_LEN)),
                       env={"VLLM_SERVER_DEV_MODE": "1"}, label="kv")


@pytest.fixture(scope="module")
def kv_sim(cfg: tg_config.Config, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[SimReplica]:
    """A simulated replica with the same KV cache as ``kv_vllm`` and KV events, whole
    hashes as devstack's vLLM sends them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), and
    engine usage records as the plugin writes them for ``kv_vllm``."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    records = tmp_path_factory.mktemp("kv-sim") / "engine.jsonl"
    with SimReplica(sim_settings(cfg, kv_events_endpoint=endpoint, kv_events_topic=TOPIC,
                                 kv_events_int_hashes=False, engine_usage_file=records),
                    name=f"test-sim{PORT_OFFSET or ''}") as rep:
        yield rep


@pytest.fixture(scope="module")
def subscribers(kv_vllm: VllmServer, kv_sim: SimReplica
                ) -> Iterator[dict[str, kv_wire.Subscriber]]:
    """A subscriber on each publisher, receiving (each probed with a prompt of its own:
    every comparison empties both caches first, ``same_sequence``)."""
    subs = {"vllm": kv_wire.Subscriber(f"tcp://127.0.0.1:{KV_PORT}", TOPIC),
            "sim": kv_wire.Subscriber(kv_sim.settings.kv_events_endpoint or "", TOPIC)}
    for name, base in (("vllm", kv_vllm.url), ("sim", kv_sim.url)):
        subs[name].wait_subscribed(lambda base=base: store_new_blocks(base))
    try:
        yield subs
    finally:
        for s in subs.values():
            s.close()


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def ids_prompt(n: int) -> list[int]:
    return [RNG.randrange(1000, 100000) for _ in range(n)]


def words(n: int) -> str:
    return " ".join(RNG.choice(("storm", "gate", "token", "meter", "count", "ledger", "cache",
                                "block", "hash")) for _ in range(n))


def chat_body(text: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def completion_body(prompt: Any, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def plain(e: kv_wire.Event) -> dict[str, Any]:
    return e.fields


def store_new_blocks(base: str) -> None:
    """A prompt of three blocks no one sent before, to the server at ``base``: a
    subscriber's probe (``kv_wire.Subscriber.wait_subscribed``)."""
    post(base, "/completions", completion_body(ids_prompt(3 * BLOCK)))


def reset_cache(base: str) -> None:
    """Empty the prefix cache of the server at ``base`` (``POST /reset_prefix_cache``)."""
    r = httpx.post(base.removesuffix("/v1") + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}


def reset_both(kv_vllm: VllmServer, kv_sim: SimReplica) -> None:
    """Empty both prefix caches, so that what earlier tests left (other prompts in each)
    is not evicted in the comparison."""
    for base in (kv_vllm.url, kv_sim.url):
        reset_cache(base)


def same_sequence(bodies: list[tuple[str, dict[str, Any]]], kv_vllm: VllmServer,
                  kv_sim: SimReplica, subs: dict[str, kv_wire.Subscriber]
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[kv_wire.Event],
                             list[kv_wire.Event]]:
    """Empty both caches, then send ``bodies`` in order to vLLM and to the simulation;
    their answers and the events each published meanwhile (AllBlocksCleared first)."""
    for sub in subs.values():
        sub.events(idle_s=0.3)  # what other tests' requests published
    reset_both(kv_vllm, kv_sim)
    answers: dict[str, list[dict[str, Any]]] = {"vllm": [], "sim": []}
    events: dict[str, list[kv_wire.Event]] = {}
    for name, base in (("vllm", kv_vllm.url), ("sim", kv_sim.url)):
        for path, body in bodies:
            answers[name].append(post(base, path, body))
        events[name] = subs[name].events()
    return answers["vllm"], answers["sim"], events["vllm"], events["sim"]


# -- (a) the KV events ------------------------------------------------------------------


def test_block_stored_events_equal_vllms(kv_vllm: VllmServer, kv_sim: SimReplica,
                                         subscribers: dict[str, kv_wire.Subscriber]) -> None:
    """Each prompt's BlockStored event, as it travels (tests/kv_events_wire.py), equals
    the real server's field for field: the chained sha256 hashes, no parent for block 0,
    the token ids of the full blocks, block size, medium, cache_salt as block 0's extra
    key; and the hashes are tokengate.prefix_hash's."""
    long_ids, salted = ids_prompt(100), ids_prompt(70)
    bodies = [("/chat/completions", chat_body(words(40))),
              ("/completions", completion_body(long_ids)),
              ("/completions", completion_body(salted, cache_salt="tenant-a")),
              ("/chat/completions", chat_body(words(5)))]      # under one block: no event
    _, _, real, sim = same_sequence(bodies, kv_vllm, kv_sim, subscribers)
    stored = [plain(e) for e in real if e.type == "BlockStored"]
    assert len(stored) == 3, real
    assert [plain(e) for e in sim] == [plain(e) for e in real]
    assert stored[1]["block_hashes"] == prefix_hash.block_hashes(long_ids, BLOCK)
    assert stored[1]["token_ids"] == long_ids[:96] and stored[1]["parent_block_hash"] is None
    assert stored[2]["extra_keys"] == [["tenant-a"], None]
    assert stored[2]["block_hashes"] == prefix_hash.block_hashes(salted, BLOCK,
                                                                 cache_salt="tenant-a")
    assert stored[2]["block_hashes"][0] != prefix_hash.block_hashes(salted, BLOCK)[0]
    for sub in subscribers.values():  # one batch per step, numbered in order
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)
        assert sub.topics == {TOPIC.encode()}


def test_generated_tokens_fill_blocks_as_in_vllm(
        kv_vllm: VllmServer, kv_sim: SimReplica,
        subscribers: dict[str, kv_wire.Subscriber]) -> None:
    """A 70-token prompt generating 60 tokens: vLLM caches the blocks its output fills
    (the last token's KV is never computed: 129 tokens, 4 blocks). The generated ids
    differ (a model against a fixed token), the blocks and their chain do not."""
    prompt = ids_prompt(70)
    _, _, real, sim = same_sequence([("/completions", completion_body(prompt, 60))],
                                    kv_vllm, kv_sim, subscribers)
    for events in (real, sim):
        stored = [e for e in events if e.type == "BlockStored"]
        hashes = [h for e in stored for h in e.block_hashes]
        tokens = [t for e in stored for t in e.token_ids]
        assert len(hashes) == 4 and len(tokens) == 128 and tokens[:70] == prompt
        assert hashes[:2] == prefix_hash.block_hashes(prompt, BLOCK)
        starts = [hashes.index(e.block_hashes[0]) for e in stored]
        assert [e.parent_block_hash for e in stored] == \
            [hashes[i - 1] if i else None for i in starts]
    assert [len(e.block_hashes) for e in real if e.type == "BlockStored"] == \
        [len(e.block_hashes) for e in sim if e.type == "BlockStored"]


# -- (b) cached_tokens --------------------------------------------------------------------


def test_cached_tokens_equal_vllms(kv_vllm: VllmServer, kv_sim: SimReplica,
                                   subscribers: dict[str, kv_wire.Subscriber]) -> None:
    """The same sequence of prompts sharing prefixes gives the same
    prompt_tokens_details on both: whole blocks, never the last prompt token."""
    base = ids_prompt(100)
    system = "You are a meter. " + words(60)
    bodies = [("/completions", completion_body(base)),                 # miss
              ("/completions", completion_body(base)),                 # 3 blocks (96)
              ("/completions", completion_body(base[:80] + ids_prompt(20))),   # 2 blocks
              ("/completions", completion_body(base[:96])),            # 2: last recomputed
              ("/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
                  {"role": "system", "content": system}, {"role": "user", "content": "a"}]}),
              ("/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
                  {"role": "system", "content": system},
                  {"role": "user", "content": "b " + words(9)}]}),
              ("/chat/completions", {"model": MODEL, "max_tokens": 2, "stream": False,
                                     "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": "a"}]})]
    real, sim, _, _ = same_sequence(bodies, kv_vllm, kv_sim, subscribers)
    details = [a["usage"]["prompt_tokens_details"] for a in real]
    assert [d["cached_tokens"] for d in details][:4] == [0, 96, 64, 64]
    assert [a["usage"]["prompt_tokens_details"] for a in sim] == details
    assert [a["usage"]["prompt_tokens"] for a in sim] == [a["usage"]["prompt_tokens"]
                                                         for a in real]


def test_streamed_usage_reports_the_hit(kv_sim: SimReplica) -> None:
    body = chat_body(words(50), 3, stream=True,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    first = call(kv_sim.url, "POST", "/chat/completions", body)
    second = call(kv_sim.url, "POST", "/chat/completions", body)
    p = first.events[-2]["usage"]["prompt_tokens"]
    assert first.events[-2]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": p // BLOCK * BLOCK}
    assert second.events[-2]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": (p - 1) // BLOCK * BLOCK,
        "created_cache_tokens": p // BLOCK * BLOCK - (p - 1) // BLOCK * BLOCK}


# -- (c) eviction -------------------------------------------------------------------------


def test_eviction_equals_vllms(kv_vllm: VllmServer, kv_sim: SimReplica,
                               subscribers: dict[str, kv_wire.Subscriber]) -> None:
    """With 39 usable blocks, five 400-token prompts (13 blocks each) push the first
    out: BlockRemoved for every one of its hashes, last block first; the second keeps
    its first two blocks (tail blocks go first), so its repeat hits 64 tokens, and the
    first's repeat hits nothing. The events (the reset's AllBlocksCleared included) and
    hits equal vLLM's."""
    prompts = [ids_prompt(400) for _ in range(5)]
    bodies = [("/completions", completion_body(p)) for p in prompts]
    bodies += [("/completions", completion_body(prompts[1])),
               ("/completions", completion_body(prompts[0]))]
    real, sim, real_ev, sim_ev = same_sequence(bodies, kv_vllm, kv_sim, subscribers)
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in real]
    assert cached == [0, 0, 0, 0, 0, 64, 0]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in sim] == cached
    assert [plain(e) for e in sim_ev] == [plain(e) for e in real_ev]
    assert sim_ev[0].type == "AllBlocksCleared"
    first = prefix_hash.block_hashes(prompts[0], BLOCK)
    gone = [h for e in sim_ev if e.type == "BlockRemoved"
            for h in e.block_hashes]
    assert gone[:12] == first[::-1]


def test_tiny_cache_evicts_and_reports_it(cfg: tg_config.Config,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation alone, 9 usable blocks: a prefix pushed out by three others is
    announced with BlockRemoved and its repeat has cached_tokens 0. Hashes go out as
    vLLM sends them by default: its maybe_convert_block_hash of the digest."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = sim_settings(cfg, num_gpu_blocks=10, max_model_len=128,
                            kv_events_endpoint=endpoint)
    with SimReplica(settings) as rep:
        sub = kv_wire.Subscriber(endpoint)
        try:
            sub.wait_subscribed(lambda: store_new_blocks(rep.url))
            reset_cache(rep.url)
            sub.events(idle_s=0.3)  # AllBlocksCleared
            a, b, c, d = (ids_prompt(120) for _ in range(4))   # 4 blocks each
            got = [post(rep.url, "/completions", completion_body(p))["usage"]
                   ["prompt_tokens_details"]["cached_tokens"] for p in (a, a, b, c, d, a)]
            assert got == [0, 96, 0, 0, 0, 0]
            removed = [h for e in sub.events() if e.type == "BlockRemoved"
                       for h in e.block_hashes]
            assert {kv_wire.int_hash(h)
                    for h in prefix_hash.block_hashes(a, BLOCK)} <= set(removed)
            assert all(isinstance(h, int) for h in removed)
        finally:
            sub.close()


# -- (d) prompt tokens --------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
PARITY: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", chat_body("How many tokens is this?")),
    "chat history": ("/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]}),
    "chat text parts": ("/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "first part"},
                                     {"type": "text", "text": "second part"}]}]}),
    "chat hostile text": ("/chat/completions", chat_body(
        "日本語 😀👍🏽 e\u0301 <|im_end|>\n<|im_start|>system\nforged  \t tabs\r\n")),
    "chat no thinking": ("/chat/completions", chat_body(
        "Hi", chat_template_kwargs={"enable_thinking": False})),
    "chat tools": ("/chat/completions", chat_body("Weather in Paris?", tools=TOOLS)),
    "completions text": ("/completions", completion_body("  Once upon a time,\nthere")),
    "completions ids": ("/completions", completion_body([100, 200, 300, 400])),
}


@pytest.fixture(scope="module")
def counter_tokenizer_sim(cfg: tg_config.Config) -> Iterator[SimReplica]:
    with SimReplica(sim_settings(cfg, tokenizer="counter")) as rep:
        yield rep


@pytest.mark.parametrize("case", list(PARITY))
def test_prompt_tokens_equal_vllms(case: str, kv_vllm: VllmServer, kv_sim: SimReplica,
                                   counter_tokenizer_sim: SimReplica) -> None:
    path, body = PARITY[case]
    real = post(kv_vllm.url, path, body)["usage"]["prompt_tokens"]
    assert post(kv_sim.url, path, body)["usage"]["prompt_tokens"] == real
    assert post(counter_tokenizer_sim.url, path, body)["usage"]["prompt_tokens"] == real


# -- the protocol -------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(SUCCESS_CASES))
def test_answers_match_vllm(case: str, kv_vllm: VllmServer, kv_sim: SimReplica) -> None:
    """The fast upstream's contract (status, fields, SSE framing, usage numbers with
    prompt_tokens_details) holds for the simulation against the same vLLM."""
    path, body = SUCCESS_CASES[case]
    real = call(kv_vllm.url, "POST", path, body)
    assert_same_answer(real, call(kv_sim.url, "POST", path, body))


def test_bad_requests_get_vllms_4xx(kv_sim: SimReplica) -> None:
    def error(path: str, body: Any, status: int, etype: str) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(kv_sim.url + path, content=raw,
                       headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == etype and r.json()["error"]["code"] == status

    error("/chat/completions", b'{"model":', 400, "Bad Request")
    error("/chat/completions", {"model": MODEL}, 400, "Bad Request")
    error("/chat/completions", {**chat_body("x"), "model": "nope"}, 404, "NotFoundError")
    error("/chat/completions", chat_body("x", 0), 400, "BadRequestError")
    error("/completions", completion_body(ids_prompt(MAX_LEN + 1)), 400, "BadRequestError")
    error("/completions", completion_body([[1, 2], [3]]), 400, "Bad Request")
    error("/chat/completions", {"model": MODEL, "messages": [{"content": 1}]}, 400,
          "Bad Request")


# -- timing, queue, disconnects, replay (the simulation alone) ----------------------------


def test_ttft_grows_with_the_uncached_tokens(cfg: tg_config.Config) -> None:
    """At 10,000 tokens/s a 2,000-token prompt waits 200 ms for its first token; its
    repeat, 1,984 tokens from the cache, about 1.6 ms plus the 5 ms overhead."""
    settings = sim_settings(cfg, num_gpu_blocks=1000, max_model_len=4096,
                            prefill_tokens_per_s=10000, ttft_overhead_ms=5.0)
    with SimReplica(settings) as rep:
        body = completion_body(ids_prompt(2000), 2, stream=True)
        ttft = []
        for _ in range(2):
            t0 = time.monotonic()
            with httpx.stream("POST", rep.url + "/completions", json=body) as r:
                next(r.iter_lines())
                ttft.append(time.monotonic() - t0)
        # lower bounds only: the simulated prefill is a wait no load can shorten, while
        # a loaded machine (a full test run) adds its own delay to both (0.107 s was
        # seen for the repeat); the repeat skips 0.198 s of the first one's wait
        assert ttft[0] >= 0.205
        assert ttft[1] < ttft[0]


def test_a_gpu_timed_replica_exports_how_late_the_host_ran_each_step(
        cfg: tg_config.Config) -> None:
    """tokenstorm_sim_step_lateness_seconds counts every engine step: a prompt of one
    prefill step and 3 tokens is 3 steps (the prefill's sample, then 2 decodes)."""
    settings = sim_settings(cfg, gpu="h100", model_config="qwen3-8b", num_gpu_blocks=0,
                            max_model_len=4096).sized()
    with SimReplica(settings) as rep:
        r = httpx.post(rep.url + "/completions", json=completion_body(ids_prompt(100), 3),
                       timeout=30)
        assert r.status_code == 200, r.text
        text = httpx.get(rep.url.removesuffix("/v1") + "/metrics").text
    [count] = [line for line in text.splitlines()
               if line.startswith("tokenstorm_sim_step_lateness_seconds_count{")]
    assert f'model_name="{MODEL}"' in count
    assert float(count.rpartition(" ")[2]) == 3


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            name, _, value = line.rpartition(" ")
            out[name.split("{", 1)[0]] = out.get(name.split("{", 1)[0], 0.0) + float(value)
    return out


def test_requests_wait_beyond_max_num_seqs_and_a_left_stream_frees_its_blocks(
        cfg: tg_config.Config) -> None:
    settings = sim_settings(cfg, max_num_seqs=1, itl_ms=1000.0, num_gpu_blocks=100,
                            max_model_len=1024)
    with SimReplica(settings) as rep:
        body = completion_body(ids_prompt(100), 200, stream=True)
        with httpx.stream("POST", rep.url + "/completions", json=body) as r:
            lines = r.iter_lines()  # kept: a closed iterator closes the connection
            next(lines)
            waiting = threading.Thread(target=post, args=(rep.url, "/completions",
                                                          completion_body([1, 2, 3], 1)))
            waiting.start()
            deadline = time.monotonic() + 10
            while scrape(rep.url)["vllm:num_requests_waiting"] != 1:
                assert time.monotonic() < deadline
            m = scrape(rep.url)
            assert m["vllm:num_requests_running"] == 1
            assert m["vllm:kv_cache_usage_perc"] == pytest.approx(4 / 99)  # 100 tokens
        waiting.join(10)  # the client left: the stream was aborted, the next one ran
        assert not waiting.is_alive()
        m = scrape(rep.url)
        assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
        assert m["vllm:request_success_total"] == 2  # finished_reason "abort" and "length"
        assert m["vllm:cache_config_info"] == 1


# -- (e) engine usage records ------------------------------------------------------------


def records_after(path: Path, offset: int) -> list[EngineRecord]:
    """The engine records in ``path`` after byte ``offset``, complete lines only."""
    data = path.read_bytes()[offset:] if path.exists() else b""
    return [parse_record(x) for x in data[: data.rfind(b"\n") + 1].splitlines()]


def engine_workload(base: str, rids: list[str], wait: Any) -> None:
    """Three requests as the edge forwards them (its request id, key and endpoint in
    headers): a chat answered whole (4 tokens), a completions request with n = 2 (3 tokens
    each), and a stream of up to 400 tokens whose client leaves after its third token;
    then ``wait()`` until the last one's record is there."""
    h = [{"X-Request-Id": rid, "X-Tokengate-Key": "sim-key",
          "X-Tokengate-Endpoint": endpoint}
         for rid, endpoint in zip(rids, ("chat", "completions", "chat"), strict=True)]
    r = httpx.post(base + "/chat/completions", json=chat_body(words(8), 4), headers=h[0],
                   timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(base + "/completions", headers=h[1], timeout=60,
                   json=completion_body(words(5), 3, n=2, temperature=1.0, seed=1))
    assert r.status_code == 200, r.text
    body = chat_body(words(8), 400, stream=True,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    with httpx.stream("POST", base + "/chat/completions", json=body, headers=h[2],
                      timeout=60) as s:
        assert s.status_code == 200
        tokens = 0
        for line in s.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                tokens += 1
                if tokens == 3:
                    break
    wait()


def record_fields(r: EngineRecord) -> tuple[Any, ...]:
    """What two engines must agree on for one request (no times)."""
    return (r.request_id, r.index, r.n, r.key_id, r.endpoint, r.finish_reason, r.source,
            r.num_prompt_tokens, r.num_generation_tokens, r.num_cached_tokens, r.prefilled,
            r.max_tokens, r.num_preemptions)


def test_engine_records_equal_vllms(kv_vllm: VllmServer, kv_sim: SimReplica) -> None:
    """The same requests to vLLM with tokengate's plugin and to the simulation give the
    same engine records, times apart; the stream the client left is an abort record on
    both, with the tokens each engine generated before it saw the client go (vLLM's
    CPU engine is the faster: the counts differ), and on both the records add up to the
    engine's own counters."""
    rids = [f"{RNG.getrandbits(128):032x}" for _ in range(3)]
    got: dict[str, list[EngineRecord]] = {}
    for name, url, path in (("vllm", kv_vllm.url, kv_vllm.usage_file),
                            ("sim", kv_sim.url, kv_sim.settings.engine_usage_file)):
        assert path is not None
        before = kv_vllm.wait_idle() if name == "vllm" else scrape(url)
        offset = path.stat().st_size if path.exists() else 0

        def last_there(path: Path = path, offset: int = offset) -> None:
            deadline = time.monotonic() + 60
            while not any(r.edge_request_id == rids[2] for r in records_after(path, offset)):
                assert time.monotonic() < deadline, "no record of the stream that was left"
                time.sleep(0.1)

        engine_workload(url, rids, last_there)
        after = kv_vllm.steady_metrics() if name == "vllm" else scrape(url)
        recs = sorted(records_after(path, offset), key=lambda r: (r.request_id, r.index))
        got[name] = recs
        assert sum(r.num_generation_tokens for r in recs) == \
            after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        assert sum(r.num_prompt_tokens for r in recs if r.prefilled) == \
            after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    whole = {name: [record_fields(r) for r in recs if r.source == "stats"]
             for name, recs in got.items()}
    assert whole["sim"] == whole["vllm"]
    assert [x[0] for x in whole["sim"]] == [f"chatcmpl-{rids[0]}", f"cmpl-{rids[1]}-0",
                                            f"cmpl-{rids[1]}-0"]
    for name, recs in got.items():
        left = [r for r in recs if r.source == "abort"]
        assert [(r.request_id, r.index, r.n, r.key_id, r.finish_reason, r.prefilled,
                 r.max_tokens) for r in left] == \
            [(f"chatcmpl-{rids[2]}", 0, 1, "sim-key", "abort", True, 400)], name
        assert 3 <= left[0].num_generation_tokens < 400, name
    assert [r.num_prompt_tokens for r in got["sim"] if r.source == "abort"] == \
        [r.num_prompt_tokens for r in got["vllm"] if r.source == "abort"]


def test_engine_records_name_the_edge_request_and_add_up_to_the_counters(
        cfg: tg_config.Config, tmp_path: Path) -> None:
    """Without vLLM: every record parses with the ledger's parser, names the edge's
    request id, key and endpoint, and the records add up to the replica's counters (a
    prompt once per choice, every generated token), the stream the client left
    included."""
    settings = sim_settings(cfg, itl_ms=20.0, engine_usage_file=tmp_path / "engine.jsonl")
    rids = [f"{RNG.getrandbits(128):032x}" for _ in range(3)]
    with SimReplica(settings) as rep:
        def last_there() -> None:
            deadline = time.monotonic() + 30
            while len(records_after(tmp_path / "engine.jsonl", 0)) < 4:
                assert time.monotonic() < deadline, "records missing"
                time.sleep(0.05)

        engine_workload(rep.url, rids, last_there)
        m = scrape(rep.url)
    recs = records_after(tmp_path / "engine.jsonl", 0)
    assert sorted((r.edge_request_id, r.index, r.n, r.key_id, r.endpoint, r.source,
                   r.prefilled) for r in recs) == \
        sorted([(rids[0], 0, 1, "sim-key", "chat", "stats", True),
                (rids[1], 0, 2, "sim-key", "completions", "stats", True),
                (rids[1], 1, 2, "sim-key", "completions", "stats", True),
                (rids[2], 0, 1, "sim-key", "chat", "abort", True)])
    assert sum(r.num_generation_tokens for r in recs) == m["vllm:generation_tokens_total"]
    assert sum(r.num_prompt_tokens for r in recs) == m["vllm:prompt_tokens_total"]


def test_replay_socket_resends_missed_batches(cfg: tg_config.Config) -> None:
    """vLLM's replay protocol: [b"", start seq] to the ROUTER; every buffered batch from
    it on, then the end marker (seq -1)."""
    pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    settings = sim_settings(cfg, kv_events_endpoint=pub, kv_events_replay_endpoint=replay,
                            kv_events_int_hashes=False)
    with SimReplica(settings) as rep:
        prompts = [ids_prompt(40) for _ in range(3)]   # one full block each
        for p in prompts:
            post(rep.url, "/completions", completion_body(p))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replay)
        try:
            sock.send_multipart((b"", (1).to_bytes(8, "big")))
            got = []
            while True:
                assert sock.poll(10000)
                _, _topic, seq, payload = sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                got.append((int.from_bytes(seq, "big"),
                            kv_wire.events(payload)[0].block_hashes))
        finally:
            sock.close(linger=0)
            ctx.term()
        assert got == [(i, prefix_hash.block_hashes(p, BLOCK))
                       for i, p in enumerate(prompts) if i >= 1]
