"""Prefix-cache routing against the real vLLM CPU server (the session's, which publishes
its KV events because the test configuration routes by the prefix cache:
devstack.vllm_service): the counter's block hashes are the ones vLLM publishes in its
``BlockStored`` events, block for block, and the hit the counter reports for the replica
(from those events) is the ``cached_tokens`` vLLM then reports.

The events are read here with vLLM's own types (not the counter's), the prompts' token
ids with vLLM's own ``POST /tokenize``. Each run's prompts begin with a fresh nonce, so
the shared server holds none of their blocks before the test sends them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tokengate import prefix_hash
from tokengate.v1 import counter_pb2, counter_pb2_grpc

from tests import kv_events_wire as kv_wire
from tests.conftest import KV_EVENTS, MODEL, VLLM_PORT
from tests.fixtures_vllm import VllmFactory, VllmServer

BLOCK = 128  # vLLM CPU's default block size, as tokengate.yaml's routing says
VLLM = f"127.0.0.1:{VLLM_PORT}"
ENDPOINTS = {"chat/completions": counter_pb2.ENDPOINT_CHAT,
             "completions": counter_pb2.ENDPOINT_COMPLETIONS,
             "messages": counter_pb2.ENDPOINT_MESSAGES}
WORDS = ("gateway", "token", "replica", "cache", "block", "prefix", "tenant", "prompt",
         "stream", "usage", "limit", "budget", "ledger", "edge", "counter", "events", "hash",
         "chain", "window")


def text(n: int, rng: Any) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def kv_server(vllm_server: VllmFactory) -> VllmServer:
    server = vllm_server()
    assert "--kv-events-config" in server.argv
    return server


@pytest.fixture
def sub(kv_server: VllmServer, http: httpx.Client) -> Iterator[kv_wire.Subscriber]:
    s = kv_wire.Subscriber(f"tcp://{KV_EVENTS}")

    def probe() -> None:  # several blocks of a prompt no one sent before
        r = http.post("v1/completions", json={
            "model": MODEL, "max_tokens": 1,
            "prompt": f"[{secrets.token_hex(8)}] " + "ready " * (3 * BLOCK)})
        assert r.status_code == 200, r.text

    try:
        s.wait_subscribed(probe)
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def http(kv_server: VllmServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{VLLM}/", timeout=300) as c:
        yield c


def count(stub: counter_pb2_grpc.TokenCounterStub, path: str,
          body: dict[str, Any]) -> counter_pb2.CountReply:
    return stub.CountTokens(counter_pb2.CountRequest(
        model=MODEL, endpoint=ENDPOINTS[path], body=json.dumps(body).encode()))


def vllm_ids(http: httpx.Client, path: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as vLLM makes them (POST /tokenize)."""
    if path == "completions" and isinstance(body["prompt"], list):
        return list(body["prompt"])
    req = {"model": MODEL, "prompt": body["prompt"]} if path == "completions" else \
        {"model": MODEL, "messages": body["messages"]}
    r = http.post("tokenize", json=req)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def bodies(rng: Any) -> list[tuple[str, dict[str, Any]]]:
    nonce = secrets.token_hex(8)
    system = f"[{nonce}] You are the gateway's assistant. " + text(320, rng)
    question = text(150, rng)
    chat = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    return [
        ("chat/completions", chat),
        # the same system prompt, another question: shares its first blocks with the first
        ("chat/completions", {"messages": [chat["messages"][0],
                                           {"role": "user", "content": text(200, rng)}]}),
        # the same conversation salted: every block differs
        ("chat/completions", {**chat, "cache_salt": f"tenant-{nonce}"}),
        ("completions", {"prompt": f"[{nonce}] " + text(420, rng)}),
        ("completions", {"prompt": [1000 + rng.randrange(90_000) for _ in range(3 * BLOCK + 9)],
                         "cache_salt": "ids"}),
    ]


def test_the_counters_block_hashes_are_the_ones_vllm_publishes(
        counter_stub: counter_pb2_grpc.TokenCounterStub, http: httpx.Client,
        sub: kv_wire.Subscriber) -> None:
    import random

    rng = random.Random()
    known: dict[bytes, list[int]] = {}  # every block stored so far: hash -> its token ids
    for path, body in bodies(rng):
        body = {"model": MODEL, **body}
        ids = vllm_ids(http, path, body)
        assert len(ids) >= 2 * BLOCK + 1
        reply = count(counter_stub, path, body)
        assert reply.prompt_tokens == len(ids) and reply.block_size == BLOCK
        want = prefix_hash.block_hashes(ids, BLOCK, cache_salt=body.get("cache_salt"))
        assert reply.block_hashes == b"".join(h[:prefix_hash.PREFIX_BYTES] for h in want)

        r = http.post(f"v1/{path}", json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        stored = [e for e in sub.events() if e.type == "BlockStored"]
        assert stored, f"no BlockStored for {path}"
        for e in stored:
            assert e.block_size == BLOCK and e.medium == "GPU"
            for j, h in enumerate(e.block_hashes):
                known[h] = e.token_ids[j * BLOCK:(j + 1) * BLOCK]
        # every full block of the prompt is held now, with the counter's hash and the
        # prompt's tokens; the ones this request stored chain from the block before
        for i, h in enumerate(want):
            assert known.get(h) == ids[i * BLOCK:(i + 1) * BLOCK], (path, i)
        for e in stored:
            assert e.block_hashes[0] in want, (path, "a block not of the prompt")
            first = want.index(e.block_hashes[0])
            assert e.block_hashes == want[first:first + len(e.block_hashes)]
            assert e.parent_block_hash == (want[first - 1] if first else None)


def hit(stub: counter_pb2_grpc.TokenCounterStub, path: str, body: dict[str, Any]) -> int:
    """The counter's hit for the session's vLLM, once both workers agree on it twice in a
    row (each follows the events on its own); fails when the replica gets no entry."""
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        hits = {h.upstream: h.cached_tokens for h in count(stub, path, body).prefix_hits}
        assert VLLM in hits, f"no hit for {VLLM}: {hits}"
        seen.append(hits[VLLM])
        if len(seen) >= 4 and len(set(seen[-4:])) == 1:
            return seen[-1]
        time.sleep(0.2)
    raise AssertionError(f"the counter's hits never settled: {seen}")


def cached(usage: dict[str, Any]) -> int:
    if "cache_read_input_tokens" in usage:  # /v1/messages
        return int(usage["cache_read_input_tokens"] or 0)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_the_counters_hit_is_the_cached_tokens_vllm_reports(
        counter_stub: counter_pb2_grpc.TokenCounterStub, http: httpx.Client,
        sub: kv_wire.Subscriber) -> None:
    import random

    rng = random.Random()
    nonce = secrets.token_hex(8)
    system = f"[{nonce}] " + text(400, rng)
    turns = [{"role": "system", "content": system}, {"role": "user", "content": text(60, rng)}]
    longer = [*turns, {"role": "assistant", "content": text(150, rng)},
              {"role": "user", "content": text(80, rng)}]
    prompt = system + " " + text(30, rng)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("chat/completions", {"messages": turns}),
        ("chat/completions", {"messages": turns}),            # all of it again
        ("chat/completions", {"messages": longer}),           # the conversation goes on
        ("chat/completions", {"messages": turns, "cache_salt": "other"}),  # no hit
        ("completions", {"prompt": prompt}),
        ("completions", {"prompt": prompt + " " + text(200, rng)}),
        # the chat prompt's system turn, from an Anthropic Messages body
        ("messages", {"system": system,
                      "messages": [{"role": "user", "content": text(60, rng)}]}),
    ]
    checked = []
    for path, body in cases:
        body = {"model": MODEL, "max_tokens": 1, **body}
        predicted = hit(counter_stub, path, body)
        r = http.post(f"v1/{path}", json=body)
        assert r.status_code == 200, r.text
        assert cached(r.json()["usage"]) == predicted, (path, body.get("cache_salt"))
        checked.append(predicted)
        sub.events()  # the request's blocks have been published (and followed)
    # the cases hit what they were meant to: nothing, the whole prompt less its last
    # token, the history, nothing for another salt, the earlier prompt, the shared
    # system prompt
    assert checked[0] == checked[3] == checked[4] == 0
    assert checked[1] >= 2 * BLOCK and checked[2] >= checked[1]
    assert checked[5] >= 2 * BLOCK and checked[6] >= 2 * BLOCK
