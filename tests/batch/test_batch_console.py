"""The operator console's batch page (``/batches``) over a real Batch API stack: a key's
batches with their progress, tokens, cost at the batch price and files."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import redis
from tokengate.console import app as console_app
from tokengate.console.cli import set_admin

from tests.batch.test_batch_api import chat_line, upload
from tests.console.test_console_unit import PORT, _session, admin_digest
from tests.fixtures_batch import BatchStack


def console_of(stack: BatchStack, tmp_path: Path) -> tuple[httpx.Client, dict[str, str]]:
    """The console over the stack's Redis, alice logged in: (client, her headers)."""
    path = tmp_path / "tokengate.yaml"
    path.write_text(stack.config_path.read_text())
    set_admin(path, "alice", admin_digest())
    path.write_text(path.read_text().replace("  console:\n",
                                             f"  console:\n    listen: 127.0.0.1:{PORT}\n", 1))
    app = console_app.Console(path, redis.Redis.from_url(stack.redis.url, decode_responses=True),
                              stack.root / "usage.jsonl")
    http = httpx.Client(transport=httpx.WSGITransport(app=app),
                        base_url=f"http://127.0.0.1:{PORT}")
    headers, _ = _session(http, app)
    return http, headers


def test_the_batch_page_lists_a_keys_batches_with_progress_tokens_and_files(
        batch_stack: BatchStack, tmp_path: Path) -> None:
    c = batch_stack.client("tenant-b")
    b = c.batches.create(input_file_id=upload(c, [chat_line(0), chat_line(1)]).id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_stack.wait_batch(c, b.id)
    http, headers = console_of(batch_stack, tmp_path)
    page = http.get("/batches", params={"key": "tenant-b"}, headers=headers)
    assert page.status_code == 200
    row = re.search(rf'<tr data-id="{b.id}">(.*?)</tr>', page.text, re.DOTALL)
    assert row is not None, page.text
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row[1], re.DOTALL)
    assert cells[1].endswith(">tenant-b</a>") and cells[4] == "completed"
    assert cells[5] == "2 / 2" and cells[6] == "0"
    assert done.usage is not None
    assert cells[7] == f"{done.usage.input_tokens:,}"
    assert cells[8] == f"{done.usage.output_tokens:,}"
    assert f"output <code>{done.output_file_id}</code>" in cells[10]
    assert 'aria-current="page">Batches' in page.text
    other = http.get("/batches", params={"key": "tenant-a"}, headers=headers).text
    assert b.id not in other
