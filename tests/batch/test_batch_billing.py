"""Batch lines billed like online traffic at their own price: one usage event per line
(batch_id, custom_id), the ledger's totals equal to the sum of the output lines' usage,
the cost at ``cost.batch`` times the online price, shown by ``tokengate usage``; and the
per-key quota of enqueued tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokengate import config as tg_config
from tokengate.ledger.calculator import charge

from tests.batch.test_batch_api import chat_line, upload
from tests.conftest import MODEL
from tests.fixtures_batch import BatchStack, fast_stack

QUOTA_B = 40  # tokens: tenant-b's quota, below one line's prompt plus its limit


@pytest.fixture(scope="module")
def stack(config_path: Path, counter_addr: str) -> Iterator[BatchStack]:
    def edit(raw: dict[str, Any]) -> None:
        raw["batch"]["key_quota_tokens"] = {"tenant-b": QUOTA_B}
        raw["models"][MODEL]["cost"] = {"input": 2.0, "output": 3.0, "cached": 0.5,
                                        "batch": 0.5}
    with fast_stack(config_path, "billing", itl_ms=0.0, edit=edit) as stack:
        yield stack


def usage_json(stack: BatchStack) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--json", "--by", "key",
                        "--config", str(stack.config_path), "--redis-url", stack.redis.url],
                       capture_output=True, text=True, timeout=60, check=True)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def wait_usage(stack: BatchStack, requests: int, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = usage_json(stack)
        if doc["total"]["requests"] >= requests or time.monotonic() > deadline:
            return doc
        time.sleep(0.2)


def test_every_line_is_one_usage_event_and_the_ledger_bills_the_lines_at_batch_price(
        stack: BatchStack) -> None:
    c = stack.client("tenant-a")
    rows = [chat_line(i, max_tokens=4 + i) for i in range(5)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    done = stack.wait_batch(c, b.id)
    assert (done.status, done.request_counts.completed) == ("completed", 5)
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    usages = [o["response"]["body"]["usage"] for o in out]
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert completion == sum(4 + i for i in range(5))
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt, completion)

    events = [e for e in stack.edge.events() if e["batch_id"] == b.id]
    assert sorted(e["custom_id"] for e in events) == [f"req-{i}" for i in range(5)]
    assert {e["request_id"] for e in events} == {o["response"]["request_id"] for o in out}
    assert all(e["key_id"] == "tenant-a" and e["status"] == 200 for e in events)

    doc = wait_usage(stack, 5)
    row = next(r for r in doc["rows"] if r["key_id"] == "tenant-a")
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        5, prompt, completion)
    weights = tg_config.load(stack.config_path).models[MODEL].cost
    online = sum(charge(u["prompt_tokens"], u["completion_tokens"], weights=weights).cost
                 for u in usages)
    assert row["cost"] == pytest.approx(0.5 * online)
    assert row["endpoints"]["batch"]["requests"] == 5
    assert row["endpoints"]["batch"]["cost"] == pytest.approx(0.5 * online)
    text = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--by", "key",
                           "--config", str(stack.config_path), "--redis-url", stack.redis.url],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    header = next(ln for ln in text.splitlines() if "requests" in ln)
    assert [h.strip() for h in header.split("┃")][-3:-1] == ["batch", "batch USD"]


def test_batch_above_the_keys_quota_fails_with_token_limit_exceeded(stack: BatchStack) -> None:
    c = stack.client("tenant-b")
    b = c.batches.create(input_file_id=upload(c, [chat_line(0, max_tokens=50)]).id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    done = stack.wait_batch(c, b.id)
    assert done.status == "failed" and done.errors is not None
    (err,) = done.errors.data
    assert err.code == "token_limit_exceeded"
    assert f"quota is {QUOTA_B}" in (err.message or "")
    assert done.output_file_id is None
    # as a batch that failed any other validation: no line ran, none counted
    n = done.request_counts
    assert n is not None and (n.total, n.completed, n.failed) == (0, 0, 0)
    # nothing was sent: no usage event of tenant-b's batch
    assert [e for e in stack.edge.events() if e["batch_id"] == b.id] == []


def test_lines_admitted_within_the_quota_give_it_back_when_the_batch_ends(
        stack: BatchStack) -> None:
    c = stack.client("tenant-b")
    line = chat_line(0, max_tokens=2)
    line["body"]["messages"][0]["content"] = "x"
    b = c.batches.create(input_file_id=upload(c, [line]).id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    first = stack.wait_batch(c, b.id)
    assert first.status == "completed", first.errors
    # the quota held by the first is free again: a second of the same size fits
    b2 = c.batches.create(input_file_id=upload(c, [line]).id,
                          endpoint="/v1/chat/completions", completion_window="24h")
    assert stack.wait_batch(c, b2.id).status == "completed"
    with pytest.raises(openai.NotFoundError):
        stack.client("tenant-a").batches.retrieve(b2.id)
