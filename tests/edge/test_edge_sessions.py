"""Agent sessions at the edge (``lua/tokengate/session.lua``): where the session id comes
from, in which order, how a hostile one is bounded, the per-key session budget, and the
counter worker that counts a session's turns.

Real nginx (2 workers) and the real counter; the model's upstream is a small fake of
vLLM's three generate APIs (``AgentUpstream``: a fixed answer whose usage is the
edge's own count, X-Token-Count, plus 5 completion tokens), so no vLLM is needed. The
budget's refusal is read with the official ``openai`` and ``anthropic`` clients.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import anthropic
import httpx
import openai
import pytest
from tokengate.ledger.calculator import charge

from tests.conftest import MODEL, key_digest
from tests.fixtures_edge import (
    EDGE_DIR,
    Edge,
    QuietUpstreamHandler,
    _variants,
    at_once,
    fake_counter,
    fixed_reply,
    session_for,
)

COMPLETION = 5  # tokens every answer of the fake generates
KEY = "tg-test-sessions"
BUDGET_KEY = "tg-test-sessions-budget"
BUDGET_TOKENS = 100
SPEND_KEY = "tg-test-sessions-spend"


# the headers of each request the fake was sent, in order
SEEN: list[dict[str, str]] = []


class _Handler(QuietUpstreamHandler):
    """POST /v1/chat/completions, /v1/messages, /v1/responses: one non-streamed answer in
    the API's shape, usage = the edge's count (X-Token-Count) + COMPLETION tokens."""

    def do_POST(self) -> None:
        SEEN.append({k.lower(): v for k, v in self.headers.items()})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        p = int(self.headers.get("X-Token-Count", "0"))
        if self.path == "/v1/messages":
            out: dict[str, Any] = {
                "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": p, "output_tokens": COMPLETION}}
        elif self.path == "/v1/responses":
            out = {"id": body["request_id"], "object": "response", "created_at": 0,
                   "model": MODEL, "status": "completed", "output": [],
                   "usage": {"input_tokens": p, "output_tokens": COMPLETION,
                             "total_tokens": p + COMPLETION}}
        else:
            out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                   "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant",
                                                            "content": "ok"}}],
                   "usage": {"prompt_tokens": p, "completion_tokens": COMPLETION,
                             "total_tokens": p + COMPLETION}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def agent_upstream() -> Iterator[Callable[[dict[str, Any]], None]]:
    """The fake upstream, running; yields the edit of an edge's YAML that points the
    model at it and adds this module's keys."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{srv.server_address[1]}"]
        raw["models"][MODEL]["embedded"] = False
        raw["keys"]["sessions"] = {"sha256": key_digest(KEY), "rpm": 10_000,
                                   "tpm": 10_000_000}
        raw["keys"]["sessions-budget"] = {"sha256": key_digest(BUDGET_KEY), "rpm": 10_000,
                                          "tpm": 10_000_000,
                                          "session_budget": {"tokens": BUDGET_TOKENS}}
        raw["keys"]["sessions-spend"] = {"sha256": key_digest(SPEND_KEY), "rpm": 10_000,
                                         "tpm": 10_000_000,
                                         "session_budget": {"spend": 0.000001}}
    try:
        yield edit
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def agent_edge(config_path, counter_addr, agent_upstream) -> Iterator[Edge]:
    gen = _variants(config_path)
    start = next(gen)
    try:
        yield start("sessions-fake", agent_upstream)
    finally:
        gen.close()


def post(edge: Edge, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         key: str = KEY) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(edge.base_url + path, json=body, headers=h, timeout=60)


HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 8}
MESSAGES = {"model": MODEL, "messages": HI, "max_tokens": 8}
RESPONSES = {"model": MODEL, "input": "hi", "max_output_tokens": 8}


def session_of(edge: Edge, r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return edge.event(r.headers["x-request-id"])["session_id"]


@pytest.mark.parametrize(("path", "body", "headers", "want"), [
    ("/chat/completions", CHAT, {"X-Session-Id": "build-42"}, "build-42"),
    ("/messages", MESSAGES, {"X-Claude-Code-Session-Id": "0b6e2c1a-claude"}, "0b6e2c1a-claude"),
    ("/responses", RESPONSES, {"session-id": "019a-codex-thread"}, "019a-codex-thread"),
    ("/responses", RESPONSES, {"session_id": "older-codex"}, "older-codex"),
    ("/responses", RESPONSES, {"conversation_id": "oldest-codex"}, "oldest-codex"),
    ("/messages", {**MESSAGES, "metadata": {"user_id": "user_ab_session_cd"}}, {},
     "user_ab_session_cd"),
    ("/chat/completions", {**CHAT, "user": "end-user-7"}, {}, "end-user-7"),
    ("/chat/completions", {**CHAT, "safety_identifier": "safety-9"}, {}, "safety-9"),
    ("/chat/completions", CHAT, {}, None),
], ids=["x-session-id", "claude-code", "codex", "codex-older", "codex-conversation",
        "anthropic-metadata", "openai-user", "safety-identifier", "none"])
def test_each_source_of_a_session_id_lands_in_the_usage_event(agent_edge, path, body,
                                                              headers, want):
    assert session_of(agent_edge, post(agent_edge, path, body, headers)) == want


def test_headers_come_before_body_fields_in_a_fixed_order(agent_edge):
    every = {"X-Session-Id": "generic", "X-Claude-Code-Session-Id": "claude",
             "session-id": "codex"}
    body = {**CHAT, "user": "u", "safety_identifier": "s"}
    assert session_of(agent_edge, post(agent_edge, "/chat/completions", body, every)) == \
        "generic"
    del every["X-Session-Id"]
    assert session_of(agent_edge, post(agent_edge, "/chat/completions", body, every)) == \
        "claude"
    del every["X-Claude-Code-Session-Id"]
    assert session_of(agent_edge, post(agent_edge, "/chat/completions", body, every)) == \
        "codex"
    assert session_of(agent_edge, post(agent_edge, "/chat/completions", body)) == "s"


def test_a_request_refused_for_its_body_still_names_its_session(agent_edge):
    r = post(agent_edge, "/chat/completions", {"model": MODEL, "messages": "not a list"},
             {"X-Claude-Code-Session-Id": "refused-turn"})
    assert r.status_code == 400
    ev = agent_edge.event(r.headers["x-request-id"])
    assert (ev["status"], ev["session_id"]) == (400, "refused-turn")


def test_a_responses_chain_keeps_the_session_of_the_response_it_continues(agent_edge):
    first = post(agent_edge, "/responses", RESPONSES, {"X-Session-Id": "chain-1"})
    assert session_of(agent_edge, first) == "chain-1"
    second = post(agent_edge, "/responses",
                  {**RESPONSES, "previous_response_id": first.json()["id"]})
    assert session_of(agent_edge, second) == "chain-1"
    third = post(agent_edge, "/responses",
                 {**RESPONSES, "previous_response_id": second.json()["id"]})
    assert session_of(agent_edge, third) == "chain-1"


@pytest.mark.parametrize("raw", ["s" * 129, "tab\tinside", "naïve-ü"],
                         ids=["too-long", "control-character", "non-ascii"])
def test_a_hostile_session_id_becomes_a_bounded_digest(agent_edge, raw):
    sent = raw.encode()
    r = httpx.post(agent_edge.base_url + "/chat/completions", json=CHAT,
                   headers=[(b"Authorization", f"Bearer {KEY}".encode()),
                            (b"X-Session-Id", sent)], timeout=60)
    want = "sha256:" + hashlib.sha256(sent).hexdigest()[:32]
    assert session_of(agent_edge, r) == want


def test_a_session_header_with_a_control_character_is_not_forwarded(agent_edge):
    # vLLM's HTTP server refuses a request with one ("Invalid HTTP request received"):
    # the client saw a backend failure of a request already counted and reserved
    SEEN.clear()
    r = httpx.post(agent_edge.base_url + "/chat/completions", json=CHAT,
                   headers=[(b"Authorization", f"Bearer {KEY}".encode()),
                            (b"X-Session-Id", b"ok\x01"), (b"session-id", b"s\x7f")],
                   timeout=60)
    assert r.status_code == 200, r.text
    assert session_of(agent_edge, r) == "sha256:" + hashlib.sha256(b"ok\x01").hexdigest()[:32]
    [seen] = SEEN
    assert {"x-session-id", "session-id", "session_id"} & set(seen) == set()
    # a clean one is forwarded as sent
    SEEN.clear()
    post(agent_edge, "/chat/completions", CHAT, {"X-Session-Id": "clean-1"})
    assert SEEN[0]["x-session-id"] == "clean-1"


def test_a_session_id_of_128_printable_characters_is_kept(agent_edge):
    sid = "~ !" + "x" * 125
    r = post(agent_edge, "/chat/completions", {**CHAT, "user": sid})
    assert session_of(agent_edge, r) == sid


def _spend(edge: Edge, sid: str) -> int:
    """Requests of session ``sid`` until the edge refuses one; the tokens it billed."""
    used = 0
    for _ in range(50):
        r = post(edge, "/chat/completions", CHAT, {"X-Session-Id": sid}, key=BUDGET_KEY)
        if r.status_code != 200:
            return used
        used += int(r.headers["x-token-count"]) + COMPLETION
        # the session's tokens are counted in the log phase, after the answer was sent:
        # its usage event is written right after them
        edge.event(r.headers["x-request-id"])
    raise AssertionError("never refused")


def test_the_session_budget_refuses_in_openais_shape(agent_edge):
    used = _spend(agent_edge, "loop-openai")
    assert used >= BUDGET_TOKENS
    client = openai.OpenAI(base_url=agent_edge.base_url, api_key=BUDGET_KEY, max_retries=0,
                           default_headers={"X-Session-Id": "loop-openai"})
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8)
    assert e.value.status_code == 403
    assert e.value.body == {
        "message": f"Session 'loop-openai' of this key has used {used} tokens, its session "
                   f"budget is {BUDGET_TOKENS} tokens (session_budget.tokens): start a new "
                   "session.",
        "type": "insufficient_quota", "param": None, "code": "session_budget_exceeded"}
    ev = agent_edge.event(e.value.response.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["session_id"]) == \
        (403, "session_budget_exceeded", "loop-openai")
    # another session of the same key is not refused
    assert post(agent_edge, "/chat/completions", CHAT, {"X-Session-Id": "fresh"},
                key=BUDGET_KEY).status_code == 200


def test_the_session_budget_refuses_in_anthropics_shape(agent_edge):
    used = _spend(agent_edge, "loop-claude")
    client = anthropic.Anthropic(base_url=agent_edge.base_url.removesuffix("/v1"),
                                 api_key=BUDGET_KEY, max_retries=0,
                                 default_headers={"X-Claude-Code-Session-Id": "loop-claude"})
    with pytest.raises(anthropic.PermissionDeniedError) as e:
        client.messages.create(model=MODEL, messages=HI, max_tokens=8)
    assert e.value.status_code == 403
    assert e.value.body == {"type": "error", "error": {
        "type": "permission_error",
        "message": f"Session 'loop-claude' of this key has used {used} tokens, its session "
                   f"budget is {BUDGET_TOKENS} tokens (session_budget.tokens): start a new "
                   "session."}}


def amount(x: float) -> str:
    """Currency units as the edge writes an amount: to the nano-unit, no trailing zeros."""
    return f"{x:.9f}".rstrip("0").rstrip(".")


def test_a_spend_budget_refuses_the_session_after_the_request_that_spent_it(agent_edge):
    first = post(agent_edge, "/chat/completions", CHAT, {"X-Session-Id": "pricey"},
                 key=SPEND_KEY)
    assert first.status_code == 200
    # its spend is counted in the log phase, after the answer: its usage event comes next
    agent_edge.event(first.headers["x-request-id"])
    # the test model's weights are the defaults: one request costs more than 0.000001
    spent = charge(int(first.headers["x-token-count"]), COMPLETION).cost
    second = post(agent_edge, "/chat/completions", CHAT, {"X-Session-Id": "pricey"},
                  key=SPEND_KEY)
    assert (second.status_code, second.json()) == (403, {"error": {
        "message": f"Session 'pricey' of this key has spent {amount(spent)} USD, its session "
                   "budget is 0.000001 USD (session_budget.spend): start a new session.",
        "type": "insufficient_quota", "param": None, "code": "session_budget_exceeded"}})


def test_a_sessions_counts_go_to_one_counter_worker_unless_it_is_the_busier(
        config_path, agent_upstream):
    """A conversation's turns, each on a new connection, are counted by one counter
    worker (its session's), whose caches hold the earlier turns: with the least busy
    worker taken, ties in turn, a turn met a worker that tokenized again the turns it had
    not seen. One nginx worker's calls still leave that worker once it has two more in
    progress than the other. A fake counter of two workers (the real counter frames)
    tells which worker each call reached."""
    def edit(raw: dict[str, Any]) -> None:
        agent_upstream(raw)
        raw["edge"]["count_timeout_ms"] = 30000

    def chat(text: str) -> dict[str, Any]:
        return {**CHAT, "messages": [{"role": "user", "content": text}]}
    served: list[int] = []
    answer = threading.Event()  # worker 0 holds its calls until this is set
    answer.set()

    def gate(worker: int) -> None:
        if worker == 0:
            answer.wait(30)
    gen = _variants(config_path)
    start = next(gen)
    try:
        with fake_counter(EDGE_DIR / "affinity-counter.sock", lambda request: fixed_reply(7),
                          served=served, gate=gate) as sock:
            e = start("sessions-affinity", edit, counter_socket=sock)
            for worker in (0, 1):
                served.clear()
                turns = [post(e, "/chat/completions", chat(f"turn {i} of {worker}"),
                              {"X-Session-Id": session_for(worker)}) for i in range(6)]
                assert [r.status_code for r in turns] == [200] * 6
                assert served == [worker] * 6
            # without a session, the least busy worker, ties in turn: one of the two
            # nginx workers gets at least 3 of 6 requests, which go to both workers
            served.clear()
            anyone = [post(e, "/chat/completions", chat(f"no session {i}")) for i in range(6)]
            assert [r.status_code for r in anyone] == [200] * 6
            assert sorted(set(served)) == [0, 1]
            # worker 0 holds its calls: 8 at once reach the 2 nginx workers, one of which
            # has at least 4, and its third goes to worker 1
            served.clear()
            answer.clear()
            burst: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: burst.extend(at_once(
                8, lambda: post(e, "/chat/completions", chat(f"burst {time.monotonic_ns()}"),
                                {"X-Session-Id": session_for(0)}))))
            sender.start()
            deadline = time.monotonic() + 30
            while 1 not in served and time.monotonic() < deadline:
                time.sleep(0.01)
            spilled = 1 in served
            answer.set()
            sender.join(60)
    finally:
        answer.set()
        gen.close()
    assert spilled, served
    assert [(r.status_code, r.headers["x-token-count-source"]) for r in burst] \
        == [(200, "counter")] * 8
