"""The edge's side of the Batch API (``lua/tokengate/batch.lua``): only the service's
secret acts for another key; its lines carry their own request id and the batch's ids
into the usage event; a check is answered from the count and never billed; and a batch
that outlives its window expires with what ran."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from tokengate.batch.store import Store, now_s

from tests.batch.test_batch_api import chat_line, upload
from tests.conftest import MODEL
from tests.fixtures_batch import (
    KEYS,
    WORKER_SECRET,
    BatchStack,
    fast_stack,
)
from tests.fixtures_ledger import wait_until

LINE_ID = "0123456789abcdef0123456789abcdef"


def post(stack: BatchStack, token: str, headers: dict[str, str],
         body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{stack.edge.base_url}/chat/completions",
                      headers={"Authorization": f"Bearer {token}", **headers},
                      json=body or chat_line(0)["body"], timeout=30)


def batch_headers(key_id: str, **more: str) -> dict[str, str]:
    return {"X-Tokengate-Batch-Key": key_id, "X-Tokengate-Batch-Id": "batch_" + "a" * 24,
            "X-Tokengate-Batch-Custom-Id": "c-1", **more}


def test_an_api_key_cannot_act_for_another_key_with_the_batch_headers(
        batch_stack: BatchStack) -> None:
    r = post(batch_stack, KEYS["tenant-a"],
             batch_headers("tenant-b", **{"X-Tokengate-Batch-Line": LINE_ID,
                                          "X-Tokengate-Batch-Check": "1"}))
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    ev = batch_stack.edge.event(r.headers["X-Request-Id"])
    assert (ev["key_id"], ev["batch_id"], ev["custom_id"]) == ("tenant-a", None, None)
    assert ev["request_id"] != LINE_ID


def test_the_services_secret_acts_for_the_named_key_with_the_lines_request_id(
        batch_stack: BatchStack) -> None:
    r = post(batch_stack, WORKER_SECRET,
             batch_headers("tenant-b", **{"X-Tokengate-Batch-Line": LINE_ID}))
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == LINE_ID
    ev = batch_stack.edge.event(LINE_ID)
    assert (ev["key_id"], ev["batch_id"], ev["custom_id"]) == (
        "tenant-b", "batch_" + "a" * 24, "c-1")


def test_a_check_is_answered_from_the_count_and_writes_no_usage_event(
        batch_stack: BatchStack) -> None:
    before = len(batch_stack.edge.events())
    r = post(batch_stack, WORKER_SECRET,
             batch_headers("tenant-a", **{"X-Tokengate-Batch-Check": "1"}),
             chat_line(0, max_tokens=7)["body"])
    assert r.status_code == 200
    doc = r.json()
    assert (doc["max_tokens"], doc["model"], doc["count_source"]) == (7, MODEL, "counter")
    assert doc["prompt_tokens"] > 0
    batch_stack.edge.assert_no_event(r.headers["X-Request-Id"])
    assert len(batch_stack.edge.events()) == before


@pytest.mark.parametrize(("headers", "code"), [
    ({}, "batch_key_missing"),
    (batch_headers("nobody"), "batch_key_unknown"),
    (batch_headers("tenant-a", **{"X-Tokengate-Batch-Line": "../etc"}), "batch_line_invalid"),
])
def test_the_services_secret_without_a_valid_key_or_line_gets_400(
        batch_stack: BatchStack, headers: dict[str, str], code: str) -> None:
    r = post(batch_stack, WORKER_SECRET, headers)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == code


@pytest.fixture
def slow_stack(config_path: Path, counter_addr: str) -> Iterator[BatchStack]:
    # 200 tokens at 20 ms each, one line out at a time: the window ends mid-batch
    def edit(raw: dict[str, Any]) -> None:
        raw["batch"].update(expiry_s=3, max_in_flight=1)
    with fast_stack(config_path, "expiry", itl_ms=20.0, edit=edit) as stack:
        yield stack


def test_a_batch_past_its_window_expires_with_what_ran_and_the_rest_in_errors(
        slow_stack: BatchStack) -> None:
    c = slow_stack.client()
    rows = [chat_line(i, max_tokens=200) for i in range(20)]
    t0 = time.monotonic()
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert b.expires_at == b.created_at + 3
    done = slow_stack.wait_batch(c, b.id, timeout_s=60)
    assert done.status == "expired" and done.expired_at
    assert time.monotonic() - t0 < 30
    n = done.request_counts
    assert 0 < n.completed < 20 and n.completed + n.failed == 20
    errs = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errs} == {"batch_expired"}
    assert len(errs) == n.failed


def test_retention_deletes_ended_batches_and_files_with_their_bytes(
        batch_stack: BatchStack) -> None:
    c = batch_stack.client("tenant-b")
    f = upload(c, [chat_line(0)])
    b = batch_stack.wait_batch(c, c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert b.status == "completed" and b.output_file_id
    files_dir = batch_stack.root / "files"
    assert {f.id, b.output_file_id} <= {p.name for p in files_dir.iterdir()}
    store = Store(redis.Redis.from_url(batch_stack.redis.url, decode_responses=True),
                  files_dir, retention_s=0, create=False)
    # a second on: the objects' times are whole seconds
    assert store.expire_old(["tenant-b"], now=now_s() + 1) == 3  # batch, input, output
    for call in (lambda: c.batches.retrieve(b.id), lambda: c.files.retrieve(f.id),
                 lambda: c.files.content(b.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert {f.id, b.output_file_id} & {p.name for p in files_dir.iterdir()} == set()


def test_lines_after_an_edge_reload_go_on_new_connections(batch_stack: BatchStack) -> None:
    """nginx's reload closes the old workers' idle kept-alive connections (as its
    keepalive_timeout does after 75 s idle): the service's connections from the first
    batch are closed when the second one runs, whose lines go on new connections;
    before, each line that met a closed one failed with a broken pipe, an unknown
    outcome (a 1 s pause, the window halved, the line sent again)."""
    c = batch_stack.client()
    rows = [chat_line(i, max_tokens=2) for i in range(6)]
    first = c.batches.create(input_file_id=upload(c, rows).id,
                             endpoint="/v1/chat/completions", completion_window="24h")
    assert batch_stack.wait_batch(c, first.id).status == "completed"
    proc = batch_stack.edge.service.proc
    assert proc is not None
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    before = set(workers.read_text().split())
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: not before & set(workers.read_text().split()), 30,
               what="the old workers gone")
    log_from = batch_stack.batch.log_path.stat().st_size
    second = c.batches.create(input_file_id=upload(c, rows).id,
                              endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_stack.wait_batch(c, second.id)
    assert (done.status, done.request_counts.completed) == ("completed", 6)
    with batch_stack.batch.log_path.open() as f:
        f.seek(log_from)
        log = f.read()
    assert f"{second.id} line" not in log, log
