"""``make bench``'s cold and warm paths: a conversation's next turn (the warm path's
prompts), a session's turns (conversations whose history is messages, a session each),
the physical floor of a cold count (encode + plain nginx), each path's CPU per request by
part and the cold path's ratio to the floor."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
from tokengate import config as tg_config
from tokenstorm.prompts import Sharing

from tokengate_dev.bench.counter import conversation_bodies
from tokengate_dev.bench.stack import BENCH_KEY, BenchOptions, cpu_seconds

# a next turn's history: the share of its prompt tokens in a system message that every
# request of its tenant sends (seen before), the rest a new user message
NEXT_TURN_HISTORY = 0.9
NEXT_TURN_TENANTS = 8
# prompts whose encoding is timed for the floor; then, one at a time, for its encode
# back to back and after an idle gap
FLOOR_PROMPTS = 400
FLOOR_IDLE_PROMPTS = 100
# a session's turns: conversations, turns each, words of the system message, of each
# user turn and of each assistant turn (about 100 + 12 x 800 words: 12k tokens at the
# end), and the clients sending them at once
SESSION_CONVERSATIONS, SESSION_TURNS = 32, 12
SESSION_WORDS = (100, 300, 500)
SESSION_CLIENTS = 8

T = TypeVar("T")


def next_turn_sharing(prompt_tokens: int) -> Sharing:
    """The warm path "a conversation's next turn": ``NEXT_TURN_TENANTS`` tenants each
    with a system message of ``NEXT_TURN_HISTORY`` of the prompt (sent by every request
    of the tenant: the counter's segment cache holds it after its first), and a user
    message of words no other request has (one conversation in 2**20 per request)."""
    return Sharing(tenants=NEXT_TURN_TENANTS,
                   prefix_tokens=int(prompt_tokens * NEXT_TURN_HISTORY),
                   conversations=1 << 20)


def session_turns(url: str, model: tg_config.ModelConfig, seed: int,
                  groups: dict[str, int]) -> dict[str, Any]:
    """The warm path "a session's turns", what an agent sends: ``SESSION_CONVERSATIONS``
    conversations of ``SESSION_TURNS`` turns, each turn the whole history as messages
    (``bench.counter.conversation_bodies``, ``SESSION_WORDS``) with its conversation's
    ``X-Session-Id``, sent in order through the gateway at ``url`` by
    ``SESSION_CLIENTS`` clients at once (16 output tokens). Returns ``requests``,
    ``rps``, ``valid`` (every answer 200 and counted by the counter) and
    ``cpu_us_per_request`` of each process group of ``groups`` (µs) but this process's
    own ("tokenstorm": the clients here are this process's threads)."""
    bodies = conversation_bodies(SESSION_CONVERSATIONS, SESSION_TURNS, seed, SESSION_WORDS)
    counted: list[bool] = []

    def conversation(c: int) -> None:
        headers = {"Authorization": f"Bearer {BENCH_KEY}",
                   "X-Session-Id": f"bench-{seed}-{c}"}
        with httpx.Client(headers=headers, timeout=60) as client:
            for body in bodies[c * SESSION_TURNS:(c + 1) * SESSION_TURNS]:
                r = client.post(f"{url}/chat/completions",
                                json={**body, "model": model.name, "max_tokens": 16})
                counted.append(r.status_code == 200
                               and r.headers.get("x-token-count-source") == "counter")
    before, t0 = cpu_seconds(groups), time.monotonic()
    with ThreadPoolExecutor(SESSION_CLIENTS) as pool:
        list(pool.map(conversation, range(SESSION_CONVERSATIONS)))
    after, elapsed = cpu_seconds(groups), time.monotonic() - t0
    n = len(counted)
    return {"requests": n, "rps": round(n / elapsed, 1), "valid": all(counted),
            "cpu_us_per_request": {k: round((after[k] - before[k]) / n * 1e6, 1)
                                   for k in groups if k != "tokenstorm"}}


def encode_floor_us(model: tg_config.ModelConfig, seed: int, opts: BenchOptions,
                    idle_s: float) -> dict[str, Any]:
    """The tokenizer's part of the physical floor of a cold count: the prompts of seed
    ``seed`` (``FLOOR_PROMPTS`` of them, ``opts.prompt_tokens`` each), rendered as
    vLLM renders them, then encoded one by one in this process (CPU µs per prompt,
    ``time.process_time``): by the counter's own exact encoder
    (``PromptTokenizer.encode``: tiktoken where proven identical, else HF) and by HF
    ``tokenizers`` (``Tokenizer.encode``, ``add_special_tokens=False``). ``encode_us``
    is the cheaper of the two: no exact count can take less. ``encode_idle_us``: the
    exact encoder's p50 thread CPU µs on ``FLOOR_IDLE_PROMPTS`` more prompts (never
    encoded before), back to back and on as many others each after ``idle_s`` seconds
    asleep: what one cold encode costs at a low rate, where this kind of VM runs code
    that waited that long about twice as slowly as the same code back to back.
    ``count_idle_us``: the same for the counter's whole call on as many more chat bodies
    (``tokengate.counter.frames.answer`` in this process: protobuf, JSON, template,
    encode, block hashes, reply, metrics; no KV-event index): what a count costs the
    counter at a low rate, against the encode alone. Raises ``RuntimeError`` when
    the two encoders disagree on a prompt's length, or the counter's call with them."""
    from tokengate.counter import frames
    from tokengate.counter.counter_service import TokenCounterService
    from tokengate.counter.counting import ModelCounter
    from tokengate.counter.tokenizer import PromptTokenizer
    from tokengate.v1 import counter_pb2
    from tokenstorm.runner import prompt_builder

    builder = prompt_builder(model.dir, model.name, "chat", seed)
    texts = [builder.render_chat(builder.parts(i, opts.prompt_tokens)[1])
             for i in range(FLOOR_PROMPTS)]
    exact = PromptTokenizer.from_model_dir(model.dir, model.vocab)
    out: dict[str, Any] = {"prompts": len(texts), "encoder": exact.backend}
    lengths: dict[str, list[int]] = {}
    for name, encode in (("encoder_us", exact.encode),
                         ("hf_tokenizers_us",
                          lambda t: builder.tokenizer.encode(t, add_special_tokens=False).ids)):
        t0 = time.process_time()
        lengths[name] = [len(encode(t)) for t in texts]
        out[name] = round((time.process_time() - t0) / len(texts) * 1e6, 1)
    if lengths["encoder_us"] != lengths["hf_tokenizers_us"]:
        raise RuntimeError("the counter's encoder and HF tokenizers disagree on a prompt")
    out["prompt_tokens"] = lengths["encoder_us"][0]
    out["encode_us"] = min(out["encoder_us"], out["hf_tokenizers_us"])
    # new prompts for each of the four timings below: none meets a cache of an earlier one
    first = FLOOR_PROMPTS
    contents = [builder.parts(i, opts.prompt_tokens)[1]
                for i in range(first, first + 4 * FLOOR_IDLE_PROMPTS)]
    idle = f"after {idle_s * 1e3:g} ms idle"
    out["encode_idle_us"] = {
        label: _p50_thread_us(exact.encode, [builder.render_chat(c) for c in batch], gap_s)
        for label, gap_s, batch in (("back to back", 0.0, contents[:FLOOR_IDLE_PROMPTS]),
                                    (idle, idle_s, contents[FLOOR_IDLE_PROMPTS:
                                                            2 * FLOOR_IDLE_PROMPTS]))}
    service = TokenCounterService({model.name: ModelCounter.load(model)})
    requests = [counter_pb2.CountRequest(
        endpoint=counter_pb2.ENDPOINT_CHAT, model=model.name,
        body=json.dumps({"model": model.name, "messages": [{"role": "user", "content": c}]},
                        ensure_ascii=False).encode()).SerializeToString()
        for c in contents[2 * FLOOR_IDLE_PROMPTS:]]
    out["count_idle_us"] = {
        label: _p50_thread_us(lambda r: frames.answer(service.count, r), batch, gap_s)
        for label, gap_s, batch in (("back to back", 0.0, requests[:FLOOR_IDLE_PROMPTS]),
                                    (idle, idle_s, requests[FLOOR_IDLE_PROMPTS:]))}
    # the timed calls were counts, not error replies: the last one, again
    reply = frames.answer(service.count, requests[-1])
    counted = counter_pb2.CountReply.FromString(reply[frames.REPLY_HEADER.size:]) \
        if reply[0] == 0 else None
    if counted is None or counted.prompt_tokens != len(
            exact.encode(builder.render_chat(contents[-1]))):
        raise RuntimeError("the counter's call and its encoder disagree on a prompt")
    return out


def _p50_thread_us(work: Callable[[T], object], items: list[T], gap_s: float) -> float:
    """The p50 thread CPU µs of ``work`` on each of ``items``, each call after ``gap_s``
    seconds asleep (0: back to back)."""
    times = []
    for item in items:
        if gap_s:
            time.sleep(gap_s)
        t0 = time.thread_time_ns()
        work(item)
        times.append((time.thread_time_ns() - t0) / 1e3)
    return round(statistics.median(times), 1)


# the gateway's runs of each path (no stream): the names of their CPU entries
PATH_RUNS = {"cold": "gateway no stream", "next turn": "gateway no stream, next turn",
             "identical resend": "gateway no stream, identical resend",
             "session turns": "gateway no stream, session turns"}
# the paths whose prompts are the floor's (1k-token chats): their CPU over the floor's
FLOOR_PATHS = ("cold", "next turn", "identical resend")


def paths_cpu(fig: dict[str, Any], cpu: dict[str, dict[str, float]], floor: dict[str, Any],
           valid: dict[str, bool]) -> None:
    """``fig["paths"]``: each path's CPU per request at saturation by part (edge nginx,
    counter, their sum: µs) and whether that run was valid (``valid``: by path); the
    floor's total (encode + plain nginx's CPU per request, µs)."""
    paths = fig.setdefault("paths", {})
    for path, run in PATH_RUNS.items():
        per = cpu.get(run, {})
        edge, counter = per.get("edge nginx"), per.get("counter")
        entry = paths.setdefault(path, {})
        if edge is not None and counter is not None:
            entry.update(edge_cpu_us=edge, counter_cpu_us=counter,
                         gateway_cpu_us=round(edge + counter, 1),
                         saturation_valid=valid.get(path, True))
    plain = cpu.get("plain nginx no stream", {}).get("plain nginx")
    if plain is not None:
        floor["plain_nginx_us"] = plain
        floor["total_us"] = round(floor["encode_us"] + plain, 1)


def cold_floor_ratio(fig: dict[str, Any]) -> None:
    """``cold_cpu_floor_ratio``: the cold path's gateway CPU per request (edge +
    counter) over the floor's total, from its saturation run when that was valid, else
    from its run at ``AIM_RATE`` when that was (idle wake-ups included: an upper
    bound); ``cold_cpu_floor_source`` says which. Neither when no valid run measured it
    (a loaded machine's counter that missed the edge's timeout at saturation makes the
    edge estimate, and its CPU figures are no count's)."""
    cold, floor = fig.get("paths", {}).get("cold", {}), fig.get("floor", {})
    if "total_us" not in floor:
        return
    at = cold.get("cpu_us_at_rate", {})
    if cold.get("saturation_valid") and "gateway_cpu_us" in cold:
        us, source = cold["gateway_cpu_us"], "saturation"
    elif cold.get("valid") and "edge nginx" in at and "counter" in at:
        us, source = at["edge nginx"] + at["counter"], f"{cold['rate_rps']:g} req/s"
    else:
        return
    fig["cold_cpu_floor_ratio"] = us / floor["total_us"]
    fig["cold_cpu_floor_source"] = source
