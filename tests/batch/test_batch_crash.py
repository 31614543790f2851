"""Exactly once across crashes: SIGKILL of tokengate-batch, of the edge (nginx's whole
process group) and of Redis (append-only file, fsync on every write) while a batch
runs; every line ends in the output or the error file exactly once, and the ledger
bills each line once."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.batch.test_batch_api import chat_line, upload
from tests.batch.test_batch_billing import wait_usage
from tests.fixtures_batch import BatchStack, fast_stack

LINES = 240


@pytest.fixture
def stack(config_path: Path, counter_addr: str) -> Iterator[BatchStack]:
    # 20 tokens at 4 ms each: a line takes ~0.1 s, so the batch runs for seconds and
    # every kill lands while lines are out
    def edit(raw: dict[str, Any]) -> None:
        raw["batch"]["max_in_flight"] = 8
    with fast_stack(config_path, "crash", itl_ms=4.0, edit=edit) as stack:
        yield stack


def progress(c: openai.OpenAI, batch_id: str) -> int:
    n = c.batches.retrieve(batch_id).request_counts
    assert n is not None
    return n.completed + n.failed


def wait_progress(stack: BatchStack, c: openai.OpenAI, batch_id: str, at_least: int,
                  timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while progress(c, batch_id) < at_least:
        assert time.monotonic() < deadline, stack.batch.log_tail()
        time.sleep(0.05)


def retrieve_when_up(c: openai.OpenAI, batch_id: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_kill_9_of_worker_edge_and_redis_mid_batch_ends_every_line_once_billed_once(
        stack: BatchStack) -> None:
    c = stack.client("tenant-a")
    rows = [chat_line(i, max_tokens=20) for i in range(LINES)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    stack.wait_batch(c, b.id, until=lambda x: x.status == "in_progress")
    for part, at in (("batch", 40), ("edge", 90), ("redis", 140)):
        wait_progress(stack, c, b.id, at)
        assert progress(c, b.id) < LINES  # lines still to run: the kill lands mid-batch
        stack.kill(part)
        stack.start(part)
        retrieve_when_up(c, b.id)
    done = stack.wait_batch(c, b.id, timeout_s=180)
    assert done.status == "completed", done

    lines: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for fid in (done.output_file_id, done.error_file_id):
        if fid:
            for x in c.files.content(fid).text.splitlines():
                o = json.loads(x)
                lines[o["custom_id"]].append(o)
    assert sorted(lines) == sorted(f"req-{i}" for i in range(LINES))
    assert [k for k, v in lines.items() if len(v) != 1] == []
    assert done.request_counts.completed + done.request_counts.failed == LINES

    # every answered attempt of a line is one request id; the ledger applies each id once
    events = [e for e in stack.edge.events() if e["batch_id"] == b.id]
    ids_200: dict[str, set[str]] = defaultdict(set)
    first: dict[str, dict[str, Any]] = {}
    for e in events:
        first.setdefault(e["request_id"], e)
        if e["status"] == 200:
            ids_200[e["custom_id"]].add(e["request_id"])
    assert [k for k, v in ids_200.items() if len(v) > 1] == []
    for cid, (o,) in lines.items():
        if o["response"] and o["response"]["status_code"] == 200:
            assert o["response"]["request_id"] in ids_200[cid]
    doc = wait_usage(stack, len(first), timeout_s=60)
    row = next(r for r in doc["rows"] if r["key_id"] == "tenant-a")
    assert row["endpoints"]["batch"]["requests"] == len(first)
    billed = sum(e["completion_tokens"] for e in first.values())
    assert row["completion_tokens"] == billed
    # a line billed from an attempt cut short by a kill is billed what ran of it: the
    # bill can be below the output's usage by at most the lines out at the two kills
    # that cut connections (worker, edge: max_in_flight 8 each, 20 tokens a line)
    completed = [o for (o,) in lines.values() if o["error"] is None]
    output = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in completed)
    assert output - 2 * 8 * 20 <= billed <= output
