"""The client SDK (``tokengate_client``): the adaptive streaming buffer and token-aware
pacing.

- The buffer's rules on fixed deltas (times given, no clock), then through ``stream_text``
  and ``responses.stream_text`` against a scripted stream (a local SSE server speaking
  vLLM's chat chunks and Responses events) and the real vLLM streams behind the edge.
- The Responses API against the real stack (edge, counter, vLLM CPU): the client's count
  is the edge's ``X-Token-Count``, the usage billed is vLLM's, a stream keeps the usage of
  ``response.completed`` and settles once.
- Pacing against the real stack (edge, counter, the fast upstream): a paced loop asking for
  more than its key's TPM gets no 429 and what the limit admits; an unpaced one gets 429s
  and recovers at the ``Retry-After`` they gave. Outcomes are counts (429s, tokens), never
  latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tokengate_client import (
    AsyncClient,
    Client,
    Pacer,
    RateLimits,
    TextBuffer,
    buffer_size,
)
from tokengate_client.pacing import parse_duration
from tokenstorm.null_server import FastUpstream
from tokenstorm.process import free_port
from tokenstorm.upstream import UpstreamOptions

from tests.conftest import MODEL, key_digest
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, Edge

# -- the buffer's rules ------------------------------------------------------------------


def _pieces(deltas: list[str], size: int = 256, bound_s: float = 0.05) -> list[str]:
    """Pieces of deltas fed one a millisecond."""
    buf = TextBuffer(size, bound_s)
    out = [p for i, d in enumerate(deltas) if (p := buf.feed(d, i * 0.001))]
    rest = buf.end()
    return out + ([rest] if rest else [])


@pytest.mark.unit
def test_buffer_size_follows_the_expected_answer_length() -> None:
    assert [buffer_size(n) for n in (0, 16, 4096, 8000, 65536, 10 ** 6)] == \
        [256, 256, 256, 500, 4096, 4096]


@pytest.mark.unit
def test_pieces_end_at_sentence_ends_and_newlines() -> None:
    deltas = ["Pi is", " 3.", "14 and", " e.g.", " more. Next", " one! And?", " \"Quoted.\"",
              " Then", "\nnew line", " 你好", "。再", "见！", "「好。」", "尾"]
    assert _pieces(deltas) == [
        "Pi is 3.14 and e.g. more.",    # "3." is no end; the last end in the buffer cuts
        " Next one!",                    # "And?" still waits for what follows it
        " And?",
        " \"Quoted.\"",                  # the closing quote stays with its sentence
        " Then\n",
        "new line 你好。",                # CJK ends need no space after them
        "再见！",
        "「好。」",
        "尾",
    ]
    assert "".join(_pieces(deltas)) == "".join(deltas)


@pytest.mark.unit
def test_a_latin_sentence_end_waits_for_what_follows() -> None:
    buf = TextBuffer(256, 1.0)
    assert buf.feed("It costs 3.", 0.0) is None      # 3.14 or the end of a sentence
    assert buf.feed(" Then", 0.001) == "It costs 3."
    assert buf.end() == " Then"


@pytest.mark.unit
def test_text_without_boundaries_is_cut_at_the_buffer_size() -> None:
    deltas = ["abcd"] * 200  # 800 characters, no boundary
    pieces = _pieces(deltas, size=256, bound_s=10.0)
    assert [len(p) for p in pieces] == [256, 256, 256, 32]
    assert "".join(pieces) == "".join(deltas)


@pytest.mark.unit
def test_the_first_piece_is_held_at_most_its_time_bound() -> None:
    buf = TextBuffer(256, 0.05)
    assert buf.feed("Hel", 10.0) is None
    assert buf.deadline() == pytest.approx(10.05)
    assert buf.due(10.049) is None
    assert buf.feed("lo", 10.03) is None
    assert buf.due(10.05) == "Hello"
    # later pieces have no time bound: only boundaries, size and the end
    assert buf.feed(" wor", 10.06) is None
    assert buf.deadline() is None
    assert buf.due(99.0) is None
    assert buf.feed("ld. Bye", 99.0) == " world."
    assert buf.end() == " Bye"


@pytest.mark.unit
def test_rate_limit_headers_parse_as_the_edge_writes_them() -> None:
    assert [parse_duration(t) for t in ("250ms", "1.2s", "59s", "6m0s", "1m5s", "0s")] == \
        [0.25, 1.2, 59.0, 360.0, 65.0, 0.0]
    assert parse_duration("soon") is None and parse_duration("5") is None
    limits = RateLimits.from_headers({
        "x-ratelimit-limit-requests": "60", "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-requests": "59", "x-ratelimit-remaining-tokens": "5950",
        "x-ratelimit-reset-requests": "1m30s", "x-ratelimit-reset-tokens": "1m30s",
        "retry-after": "3"})
    assert limits == RateLimits(60, 6000, 59, 5950, 90.0, 90.0, 3.0)
    assert RateLimits.from_headers({"x-ratelimit-limit-tokens": "6000"}) is None


def _edge_headers(limit: int, prev: float, cur: float, f: float) -> RateLimits:
    """The x-ratelimit-* (tokens; requests unlimited) the edge would write for these
    window counts (lua/tokengate/local_limit.lua state(), limits.lua duration())."""
    reset = (2 - f) * 60 if cur > 0 else (1 - f) * 60 if prev > 0 else 0.0
    reset = float(math.ceil(reset)) if reset >= 60 else math.ceil(reset * 10) / 10
    remaining = max(0, math.floor(limit - prev * (1 - f) - cur + 1e-9))
    return RateLimits(10 ** 6, limit, 10 ** 6, remaining, reset, reset)


@pytest.mark.unit
def test_the_pacer_fills_a_sliding_window_without_refusals() -> None:
    """The pacer against the edge's window formula on a simulated clock: three minutes of
    a client that always wants more, each answer 0.2 s after its admission."""
    limit, cost = 6000, 47
    clock = [17.3]  # seconds; the edge's windows are [0, 60), [60, 120), ...
    pacer = Pacer(clock=lambda: clock[0])
    counts: dict[int, float] = {}
    admitted = refused = 0
    while clock[0] < 180:
        wait, ticket = pacer.acquire(cost)
        if wait > 0:
            clock[0] += wait
            continue
        w, f = int(clock[0] // 60), clock[0] % 60 / 60
        prev, cur = counts.get(w - 1, 0.0), counts.get(w, 0.0)
        if prev * (1 - f) + cur + cost > limit:
            refused += 1
            clock[0] += 1
            continue
        counts[w] = cur + cost
        admitted += cost
        headers = _edge_headers(limit, prev, cur + cost, f)
        clock[0] += 0.2
        pacer.admitted(ticket, headers)
        pacer.settle(ticket, cost)
    assert refused == 0
    # admissible: the first window's limit, then 100 tokens/s as it slides out
    assert admitted >= 0.95 * (limit + limit * 2)


# -- stream_text against a scripted stream -------------------------------------------------

SCRIPT = ["Hel", "lo world", ". This is", " 3.14", " percent", " sure!", "\n", "中文", "句子",
          "。", "Last", " words"]
LIMIT_HEADERS = {"x-ratelimit-limit-requests": "100", "x-ratelimit-limit-tokens": "10000",
                 "x-ratelimit-remaining-requests": "99",
                 "x-ratelimit-remaining-tokens": "9900",
                 "x-ratelimit-reset-requests": "1m30s", "x-ratelimit-reset-tokens": "1m30s"}
PROMPT_TOKENS = 11


def _response(status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """A Responses ``response`` object as vLLM's stream events carry it."""
    return {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL,
            "status": status, "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "usage": usage}


class ScriptedStream:
    """A local server answering every request with a stream of ``SCRIPT`` and the edge's
    headers: chat requests with SSE chunks shaped as vLLM's (cumulative usage in each, a
    final usage-only chunk, ``[DONE]``), ``/v1/responses`` with Responses events
    (``response.created``, one ``response.output_text.delta`` a text, then
    ``response.completed`` with the usage). After the first text it waits for ``go`` (set
    by the test once it holds the first piece), so that only the buffer's time bound can
    have released that piece."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.port = free_port()
        script, go = SCRIPT, self.go

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _event(self, obj: dict[str, Any] | str) -> None:
                data = obj if isinstance(obj, str) else json.dumps(obj)
                kind = "" if isinstance(obj, str) else f"event: {obj.get('type')}\n"
                self.wfile.write(f"{kind}data: {data}\n\n".encode())
                self.wfile.flush()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("X-Token-Count", str(PROMPT_TOKENS))
                for k, v in LIMIT_HEADERS.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.path.endswith("/responses"):
                    self._responses()
                else:
                    self._chat()
                self.close_connection = True

            def _chat(self) -> None:
                base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                        "model": MODEL}
                for i, text in enumerate(script, 1):
                    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": i,
                             "total_tokens": PROMPT_TOKENS + i}
                    self._event({**base, "usage": usage, "choices": [
                        {"index": 0, "delta": {"content": text}, "finish_reason": None}]})
                    if i == 1:
                        go.wait(30)
                self._event({**base, "choices": [], "usage": usage})
                self._event("[DONE]")

            def _responses(self) -> None:
                self._event({"type": "response.created", "sequence_number": 0,
                             "response": _response("in_progress", None)})
                for i, text in enumerate(script, 1):
                    self._event({"type": "response.output_text.delta", "sequence_number": i,
                                 "item_id": "msg_1", "output_index": 0, "content_index": 0,
                                 "delta": text, "logprobs": []})
                    if i == 1:
                        go.wait(30)
                usage = {"input_tokens": PROMPT_TOKENS, "output_tokens": len(script),
                         "total_tokens": PROMPT_TOKENS + len(script),
                         "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": 0}}
                self._event({"type": "response.completed", "sequence_number": len(script) + 1,
                             "response": _response("completed", usage)})

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.go.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted() -> Iterator[ScriptedStream]:
    with contextlib.closing(ScriptedStream()) as s:
        yield s


@pytest.mark.unit
def test_stream_text_pieces_of_a_scripted_stream(scripted: ScriptedStream) -> None:
    client = Client(base_url=f"http://127.0.0.1:{scripted.port}/v1", api_key="k",
                    first_piece_ms=30)
    stream = client.stream_text(model=MODEL, max_tokens=64,
                                messages=[{"role": "user", "content": "Say hello."}])
    first = next(stream)  # the server holds the rest until it is here
    scripted.go.set()
    rest = list(stream)
    assert [first, *rest] == ["Hel", "lo world.", " This is 3.14 percent sure!\n",
                              "中文句子。", "Last words"]
    assert "".join([first, *rest]) == "".join(SCRIPT)
    assert stream.usage is not None
    assert (stream.usage.prompt_tokens, stream.usage.completion_tokens) == \
        (PROMPT_TOKENS, len(SCRIPT))
    assert stream.billing.token_count == PROMPT_TOKENS
    assert stream.billing.rate_limits == RateLimits(100, 10000, 99, 9900, 90.0, 90.0)
    client.close()


@pytest.mark.unit
def test_async_stream_text_of_a_scripted_stream(scripted: ScriptedStream) -> None:
    async def run() -> tuple[list[str], Any]:
        client = AsyncClient(base_url=f"http://127.0.0.1:{scripted.port}/v1", api_key="k",
                             first_piece_ms=30)
        stream = await client.stream_text(
            model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Say hello."}])
        first = await anext(stream)
        scripted.go.set()
        pieces = [first] + [p async for p in stream]
        await client.close()
        return pieces, stream

    pieces, stream = asyncio.run(run())
    assert pieces == ["Hel", "lo world.", " This is 3.14 percent sure!\n", "中文句子。",
                      "Last words"]
    assert stream.usage.completion_tokens == len(SCRIPT)
    assert stream.billing.token_count == PROMPT_TOKENS


@pytest.mark.unit
def test_responses_stream_text_pieces_of_a_scripted_stream(scripted: ScriptedStream) -> None:
    """The same pieces as chat's, over Responses events; the usage is
    ``response.completed``'s, the pacer settled once with input + output tokens."""
    client = Client(base_url=f"http://127.0.0.1:{scripted.port}/v1", api_key="k",
                    first_piece_ms=30)
    settled = _record_settlements(client)
    stream = client.responses.stream_text(model=MODEL, input="Say hello.",
                                          max_output_tokens=64)
    first = next(stream)  # the server holds the rest until it is here
    assert stream.usage is None  # a Responses stream has no running usage
    scripted.go.set()
    rest = list(stream)
    assert [first, *rest] == ["Hel", "lo world.", " This is 3.14 percent sure!\n",
                              "中文句子。", "Last words"]
    assert stream.usage is not None
    assert (stream.usage.input_tokens, stream.usage.output_tokens,
            stream.usage.total_tokens) == (PROMPT_TOKENS, len(SCRIPT), PROMPT_TOKENS + 12)
    assert stream.billing.token_count == PROMPT_TOKENS
    assert stream.billing.estimate is None  # no config: nothing counted
    client.close()
    assert settled == [PROMPT_TOKENS + len(SCRIPT)]


def _record_settlements(client: Client | AsyncClient) -> list[int]:
    """The billed tokens of every settlement of ``client``'s pacer, in order."""
    settled: list[int] = []
    pacer = client._core.pacer
    assert pacer is not None
    settle = pacer.settle

    def record(ticket: Any, billed_tokens: int) -> None:
        settled.append(billed_tokens)
        settle(ticket, billed_tokens)
    pacer.settle = record  # type: ignore[method-assign]
    return settled


# -- pacing against the real stack ---------------------------------------------------------

TPM = 1500          # 25 tokens/s: a loaded machine's client still outruns it
MAX_TOKENS = 30     # the fast upstream generates exactly this; reservation = billed
PACED_KEY, UNPACED_KEY = "tg-test-client-paced", "tg-test-client-unpaced"
STEADY_S = 20       # how long the loops run into the window after the one they start in


@pytest.fixture
def paced_edge(edge_variant_off_vllm: Callable[..., Edge], tmp_path: Path) -> Iterator[Edge]:
    """An edge in front of the fast upstream, with two keys of TPM ``TPM``."""
    up = FastUpstream(UpstreamOptions(model=MODEL), name="client-sdk", state_dir=tmp_path)
    up.start()

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{up.port}"]
        raw["models"][MODEL]["embedded"] = False
        for name, key in (("client-paced", PACED_KEY), ("client-unpaced", UNPACED_KEY)):
            raw["keys"][name] = {"sha256": key_digest(key), "rpm": 100000, "tpm": TPM}
    try:
        yield edge_variant_off_vllm("client-sdk", edit)
    finally:
        up.stop()


def _loop(client: Client, stop_at: float, out: dict[str, Any]) -> None:
    """Sequential chat calls until wall-clock ``stop_at``; records per call the billed
    tokens, X-Token-Count vs usage, the 429s it waited out and the seconds it paced
    before sending, and errors."""
    calls: list[tuple[int, int, int | None, int, float]] = []
    out["calls"], out["errors"] = calls, []
    i = 0
    while time.time() < stop_at:
        i += 1
        try:
            r = client.chat.completions.create(
                model=MODEL, max_tokens=MAX_TOKENS,
                messages=[{"role": "user", "content": f"Question number {i}: why?"}])
        except Exception as e:  # noqa: BLE001 - the test reports it
            out["errors"].append(repr(e))
            return
        assert r.usage is not None
        calls.append((r.usage.total_tokens, r.usage.prompt_tokens, r.token_count,
                      r.billing.rate_limited, r.billing.waited_s))


def test_pacing_reaches_the_key_rate_without_429s_and_unpaced_recovers_at_retry_after(
        paced_edge: Edge) -> None:
    # both loops start 15 s before the end of window k, a window of a clock of the
    # edge's own that runs at the real pace (so the key's counts start at 0), and stop
    # STEADY_S seconds into window k + 1
    with paced_edge.window_clock(second=45, running=True) as clock:
        boundary = clock.real_time(clock.t + 15)
        stop_at = boundary + STEADY_S
        config = EDGE_DIR / "client-sdk" / "tokengate.yaml"
        paced = Client(base_url=paced_edge.base_url, api_key=PACED_KEY, config=config)
        unpaced = Client(base_url=paced_edge.base_url, api_key=UNPACED_KEY, config=config,
                         pacing=False)
        results: dict[str, dict[str, Any]] = {"paced": {}, "unpaced": {}}
        threads = [threading.Thread(target=_loop, args=(c, stop_at, results[n]))
                   for n, c in (("paced", paced), ("unpaced", unpaced))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        paced.close()
        unpaced.close()
        ended = time.time()

    p, u = results["paced"], results["unpaced"]
    assert p["errors"] == [] and u["errors"] == []
    # the key admits TPM in window k (fresh), then TPM/60 per second as window k slides
    # out: TPM x (1 + g) by fraction g of window k + 1, when the loops stopped sending
    # (lower) and when their last answers were in (upper)
    capacity = TPM * (1 + STEADY_S / 60)
    capacity_end = TPM * (1 + min(1.0, (ended - boundary) / 60))
    paced_tokens = sum(c[0] for c in p["calls"])
    print(f"paced: {len(p['calls'])} calls, {paced_tokens} tokens of {capacity:.0f} "
          f"admissible ({paced_tokens / capacity:.1%}); unpaced: {len(u['calls'])} calls, "
          f"{sum(c[3] for c in u['calls'])} 429s")
    assert sum(c[3] for c in p["calls"]) == 0                  # no 429: it waited
    # it reached the key's rate: it had to wait for room before sending (it only waits
    # when the next request would not fit), and never went past what the key admits. How
    # close to the admissible total a loaded machine's client gets is a rate, for the
    # benchmarks, not a test (a CI run under load got 74 % of it)
    assert any(c[4] > 0 for c in p["calls"])
    assert paced_tokens <= capacity_end
    assert all(c[2] == c[1] for c in p["calls"])               # X-Token-Count = prompt
    # unpaced: 429s, each waited out by its Retry-After, after which the retry got in
    assert sum(c[3] for c in u["calls"]) > 0
    assert max(c[3] for c in u["calls"]) == 1


# -- the real vLLM stream ------------------------------------------------------------------

_END = re.compile("(\n|[\u3002\uff01\uff1f\uff1b\uff0e\u2026][\"'\u201d\u2019)\\]}\u00bb"
                  "\u300d\u300f\uff09\u3011]*|[.!?][\"'\u201d\u2019)\\]}\u00bb\u300d\u300f"
                  "\uff09\u3011]*)$")


def _assert_pieces_follow_the_rules(pieces: list[str], size: int) -> None:
    """Every piece but the first (maybe the time bound's) and the last ends at a sentence
    end or a newline, or holds ``size`` characters; a Latin end is followed by space."""
    for piece, nxt in itertools.pairwise(pieces[1:]):
        end = _END.search(piece)
        assert end or len(piece) >= size, (piece, nxt)
        if end and end.group()[0] in ".!?":  # a Latin end: white space follows
            assert nxt[:1].isspace(), (piece, nxt)


def test_stream_text_of_the_real_vllm_stream(edge: Edge) -> None:
    client = Client(base_url=edge.base_url, api_key=MAIN_KEY, first_piece_ms=40)
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 96, "temperature": 0, "seed": 7,
        "messages": [{"role": "user", "content": "Tell a story. In two sentences.\n"}]}
    stream = client.stream_text(**body)
    pieces = list(stream)
    whole = client.chat.completions.create(**body)  # greedy: the same text
    assert "".join(pieces) == whole.response.choices[0].message.content
    assert stream.usage is not None and whole.usage is not None
    assert stream.usage.completion_tokens == whole.usage.completion_tokens
    assert stream.usage.prompt_tokens == stream.billing.token_count
    _assert_pieces_follow_the_rules(pieces, buffer_size(96))
    client.close()


# -- the Responses API against the real stack -----------------------------------------------

RIVERS = "Name three rivers."
# prompt tokens of these bodies for the test model (Qwen3's tokenizer and chat template):
# what vLLM reports as usage.input_tokens
RIVERS_TOKENS, TERSE_RIVERS_TOKENS, STORY_TOKENS = 12, 21, 16


def test_paced_responses_create_counts_as_the_edge_and_bills_vllms_usage(
        edge: Edge, edge_config_path: Path) -> None:
    client = Client(base_url=edge.base_url, api_key=MAIN_KEY, config=edge_config_path)
    settled = _record_settlements(client)
    r = client.responses.create(model=MODEL, input=RIVERS, instructions="You are terse.",
                                max_output_tokens=5, extra_body={"ignore_eos": True})
    est, usage = r.billing.estimate, r.usage
    assert est is not None and usage is not None
    # counted here, before sending, exactly as the edge and vLLM count it
    assert est.prompt_tokens == r.token_count == usage.input_tokens == TERSE_RIVERS_TOKENS
    assert (est.completion_budget, est.reservation) == (5, TERSE_RIVERS_TOKENS + 5)
    assert (usage.output_tokens, usage.total_tokens) == (5, TERSE_RIVERS_TOKENS + 5)
    assert (r.billing.rate_limited, r.billing.waited_s) == (0, 0.0)
    assert settled == [TERSE_RIVERS_TOKENS + 5]
    assert r.billing.request_id is not None
    ev = edge.event(r.billing.request_id)
    assert (ev["endpoint"], ev["stream"], ev["usage_source"]) == ("responses", False, "final")
    assert (ev["prompt_tokens"], ev["completion_tokens"], ev["reserved"]) == \
        (TERSE_RIVERS_TOKENS, 5, TERSE_RIVERS_TOKENS + 5)
    client.close()


def test_responses_create_stream_keeps_the_usage_of_response_completed(
        edge: Edge, edge_config_path: Path) -> None:
    client = Client(base_url=edge.base_url, api_key=MAIN_KEY, config=edge_config_path)
    settled = _record_settlements(client)
    stream = client.responses.create(model=MODEL, input=RIVERS, max_output_tokens=6,
                                     stream=True, extra_body={"ignore_eos": True})
    with stream:
        events = list(stream)
    stream.close()  # a second close settles nothing more
    assert events[-1].type == "response.completed"
    final = events[-1].response.usage
    assert stream.usage == final and final is not None
    assert (final.input_tokens, final.output_tokens) == (RIVERS_TOKENS, 6)
    assert stream.billing.token_count == RIVERS_TOKENS
    assert stream.billing.estimate is not None
    assert stream.billing.estimate.prompt_tokens == RIVERS_TOKENS
    assert settled == [RIVERS_TOKENS + 6]
    assert stream.billing.request_id is not None
    ev = edge.event(stream.billing.request_id)
    assert (ev["endpoint"], ev["stream"], ev["usage_source"]) == ("responses", True, "final")
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (RIVERS_TOKENS, 6)
    client.close()


STORY: dict[str, Any] = {
    "model": MODEL, "input": "Tell a story. In two sentences.\n", "max_output_tokens": 48,
    "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_responses_stream_text_of_the_real_vllm_stream(edge: Edge,
                                                       edge_config_path: Path) -> None:
    client = Client(base_url=edge.base_url, api_key=MAIN_KEY, config=edge_config_path,
                    first_piece_ms=40)
    stream = client.responses.stream_text(**STORY)
    pieces = list(stream)
    whole = client.responses.create(**STORY)  # greedy: the same text
    assert "".join(pieces) == whole.response.output_text
    assert stream.usage is not None and whole.usage is not None
    assert (stream.usage.input_tokens, stream.usage.output_tokens) == (STORY_TOKENS, 48)
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (STORY_TOKENS, 48)
    assert stream.billing.token_count == STORY_TOKENS
    assert stream.billing.estimate is not None
    assert stream.billing.estimate.prompt_tokens == STORY_TOKENS
    _assert_pieces_follow_the_rules(pieces, buffer_size(48))
    assert stream.billing.request_id is not None
    ev = edge.event(stream.billing.request_id)
    assert (ev["endpoint"], ev["stream"], ev["usage_source"]) == ("responses", True, "final")
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (STORY_TOKENS, 48)
    client.close()


def test_async_responses_stream_text_of_the_real_vllm_stream(edge: Edge,
                                                             edge_config_path: Path) -> None:
    async def run() -> tuple[list[str], Any, Any, list[int]]:
        client = AsyncClient(base_url=edge.base_url, api_key=MAIN_KEY,
                             config=edge_config_path, first_piece_ms=40)
        settled = _record_settlements(client)
        stream = await client.responses.stream_text(**STORY)
        pieces = [p async for p in stream]
        whole = await client.responses.create(**STORY)
        await client.close()
        return pieces, stream, whole, settled

    pieces, stream, whole, settled = asyncio.run(run())
    assert "".join(pieces) == whole.response.output_text
    assert (stream.usage.input_tokens, stream.usage.output_tokens) == (STORY_TOKENS, 48)
    assert stream.billing.token_count == stream.billing.estimate.prompt_tokens == STORY_TOKENS
    assert settled == [STORY_TOKENS + 48, STORY_TOKENS + 48]  # the stream's, then create's
    _assert_pieces_follow_the_rules(pieces, buffer_size(48))
