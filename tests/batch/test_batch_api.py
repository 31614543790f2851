"""The Files and Batch API through the official ``openai`` client, against a real edge,
ledger and tokengate-batch in front of TokenStorm's fast upstream: shapes, isolation
between keys, bounds, lines checked at creation, cancel."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.doc_pages import code_block
from tests.fixtures_batch import KEYS, BatchStack


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def chat_line(i: int, max_tokens: int = 5, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": f"line {i}"}], **body}}


def upload(client: openai.OpenAI, rows: list[dict[str, Any]], name: str = "in.jsonl") -> Any:
    return client.files.create(file=(name, jsonl(rows)), purpose="batch")


def test_file_upload_list_retrieve_content_delete_have_openai_shapes(
        batch_stack: BatchStack) -> None:
    c = batch_stack.client()
    data = jsonl([chat_line(0)])
    f = c.files.create(file=("input.jsonl", data), purpose="batch")
    assert f.id.startswith("file-") and f.object == "file"
    assert (f.bytes, f.filename, f.purpose, f.status) == (len(data), "input.jsonl", "batch",
                                                          "processed")
    assert c.files.retrieve(f.id).model_dump() == f.model_dump()
    assert f.id in [x.id for x in c.files.list(purpose="batch")]
    assert c.files.content(f.id).read() == data
    deleted = c.files.delete(f.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (f.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def test_batch_runs_every_line_and_output_lines_carry_usage(batch_stack: BatchStack) -> None:
    c = batch_stack.client()
    rows = [chat_line(i, max_tokens=3 + i) for i in range(6)]
    f = upload(c, rows)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"run": "one"})
    assert (b.object, b.status, b.endpoint, b.completion_window, b.metadata) == (
        "batch", "validating", "/v1/chat/completions", "24h", {"run": "one"})
    assert b.expires_at == b.created_at + 86_400
    done = batch_stack.wait_batch(c, b.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 6, 0)
    assert done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(6)]
    for i, o in enumerate(out):
        assert o["error"] is None and o["id"].startswith("batch_req_")
        assert o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 3 + i
        assert o["response"]["request_id"] == o["id"].removeprefix("batch_req_")
    out_file = c.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output"
    assert done.id in [x.id for x in c.batches.list()]


def test_line_the_edge_refuses_goes_to_the_error_file_with_the_online_error(
        batch_stack: BatchStack) -> None:
    c = batch_stack.client()
    bad_model = chat_line(1)
    bad_model["body"]["model"] = "no-such-model"
    too_long = chat_line(2, max_tokens=10**7)
    rows = [chat_line(0), bad_model, too_long]
    online = httpx.post(f"{batch_stack.edge.base_url}/chat/completions",
                        headers={"Authorization": f"Bearer {KEYS['tenant-a']}"},
                        json=bad_model["body"], timeout=30)
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    done = batch_stack.wait_batch(c, b.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
        "completed", 1, 2)
    errs = {e["custom_id"]: e for e in
            map(json.loads, c.files.content(done.error_file_id).text.splitlines())}
    assert set(errs) == {"req-1", "req-2"}
    assert errs["req-1"]["response"]["status_code"] == online.status_code == 404
    assert errs["req-1"]["response"]["body"] == online.json()
    assert errs["req-2"]["response"]["status_code"] == 400
    assert errs["req-2"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    for e in errs.values():  # one id names the line's check, as for a line that ran
        assert e["id"] == "batch_req_" + e["response"]["request_id"]


def test_another_key_gets_404_for_every_file_and_batch(batch_stack: BatchStack) -> None:
    a, other = batch_stack.client("tenant-a"), batch_stack.client("tenant-b")
    f = upload(a, [chat_line(0)])
    b = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    for call in (lambda: other.files.retrieve(f.id), lambda: other.files.content(f.id),
                 lambda: other.files.delete(f.id), lambda: other.batches.retrieve(b.id),
                 lambda: other.batches.cancel(b.id),
                 lambda: other.batches.create(input_file_id=f.id,
                                              endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found"
    assert f.id not in [x.id for x in other.files.list()]
    assert b.id not in [x.id for x in other.batches.list()]
    batch_stack.wait_batch(a, b.id)


def test_requests_without_a_valid_key_get_openai_401(batch_stack: BatchStack) -> None:
    bad = openai.OpenAI(base_url=batch_stack.edge.base_url, api_key="tg-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.files.list()
    assert e.value.body["code"] == "invalid_api_key"


def test_bounds_answer_clear_4xx_in_openai_shape(batch_stack: BatchStack) -> None:
    c = batch_stack.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", b"{}\n"), purpose="assistants")
    assert e.value.body["param"] == "purpose"
    f = upload(c, [chat_line(0)])
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/audio/speech",  # type: ignore[arg-type]
                         completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="1h")  # type: ignore[arg-type]
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_../../etc/passwd")
    r = httpx.get(f"{batch_stack.edge.base_url}/files/..%2F..%2Fetc%2Fpasswd/content",
                  headers={"Authorization": f"Bearer {KEYS['tenant-a']}"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] in ("not_found", "unknown_url")
    auth = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
    r = httpx.get(f"{batch_stack.edge.base_url}/files?order=sideways", headers=auth,
                  timeout=10)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "order")
    r = httpx.post(f"{batch_stack.edge.base_url}/files", timeout=10, content=b"purpose=batch",
                   headers={**auth, "Content-Type": "multipart/form-data"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_multipart")
    cut = (b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XX\r\n'
           b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"custom')
    r = httpx.post(f"{batch_stack.edge.base_url}/files", timeout=10, content=cut,
                   headers={**auth, "Content-Type": "multipart/form-data; boundary=XX"})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, ("The upload ends without its closing boundary ('--XX--'): it may have been "
              "cut short."))
    two = httpx.post(f"{batch_stack.edge.base_url}/files", headers=auth, timeout=10,
                     data={"purpose": "batch"},
                     files=[("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n"))])
    assert (two.status_code, two.json()["error"]["message"]) == (
        400, "The upload has more than one 'file' field.")
    with pytest.raises(openai.NotFoundError) as nf:
        c.files.retrieve("notanid")
    assert nf.value.body["message"] == "No such file: 'notanid'."
    with pytest.raises(openai.NotFoundError) as nf:
        c.batches.create(input_file_id="abc", endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert (nf.value.body["message"], nf.value.body["param"]) == ("No such file: 'abc'.",
                                                                  "input_file_id")
    r = httpx.post(f"{batch_stack.edge.base_url}/batches", headers=auth, timeout=10,
                   json={"input_file_id": 5, "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"})
    assert (r.status_code, r.json()["error"]["message"]) == \
        (400, "input_file_id must be a string (a file's id).")
    # the create request's body is JSON, as every JSON API of the edge takes it
    create = json.dumps({"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"})
    for ctype in ("text/plain", "application/x-www-form-urlencoded",
                  "application/json; charset=latin-1"):
        r = httpx.post(f"{batch_stack.edge.base_url}/batches", content=create, timeout=10,
                       headers={**auth, "Content-Type": ctype})
        assert (r.status_code, r.json()["error"]["code"]) == (415, "unsupported_media_type")
    for body, code in (("{not json", "invalid_json"), ("[1]", "invalid_json"),
                       ('{"endpoint": "/v1/chat/completions", "completion_window": "24h"}',
                        "missing_required_parameter")):
        r = httpx.post(f"{batch_stack.edge.base_url}/batches", content=body, timeout=10,
                       headers={**auth, "Content-Type": "application/json; charset=utf-8"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, code), body
    # a method a path does not take: 405 naming every one it does
    for method, path, allowed in (("PUT", "/files", "GET, POST"),
                                  ("PATCH", "/batches", "GET, POST"),
                                  ("POST", f"/files/{f.id}", "GET, DELETE"),
                                  ("GET", "/batches/batch_x/cancel", "POST")):
        r = httpx.request(method, f"{batch_stack.edge.base_url}{path}", headers=auth,
                          timeout=10)
        assert (r.status_code, r.json()["error"]["message"]) == \
            (405, f"Method {method} not allowed here (allowed: {allowed})."), path
    # a create body past its 1 MiB: the service reads it before answering, so the answer
    # is its JSON 413 every time (answering first broke the connection under nginx)
    for _ in range(4):
        big = httpx.post(f"{batch_stack.edge.base_url}/batches",
                         headers={"Authorization": f"Bearer {KEYS['tenant-a']}",
                                  "Content-Type": "application/json"},
                         content=b'{"metadata": "' + b"x" * 2_000_000 + b'"}', timeout=30)
        assert (big.status_code, big.json()["error"]["code"]) == (413, "request_too_large")


def test_file_of_the_wrong_shape_fails_its_batch_naming_the_line(
        batch_stack: BatchStack) -> None:
    c = batch_stack.client()
    rows = [chat_line(0), chat_line(0)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    done = batch_stack.wait_batch(c, b.id)
    assert done.status == "failed" and done.failed_at
    assert done.errors is not None
    assert [(e.code, e.line) for e in done.errors.data] == [("duplicate_custom_id", 2)]


def test_hostile_lines_get_the_online_error_and_never_stop_the_service(
        batch_stack: BatchStack) -> None:
    """A lone surrogate in a line crashed the worker (re-encoding it as UTF-8) in a loop:
    every key's Batch API answered 502. It now reaches the edge as the client's escape
    and gets the online error; a repeated key, NaN or deep nesting fail the batch naming
    the line (a dict would have kept the last of two keys unseen); a body nested too deep
    is a 400, not a 500."""
    c = batch_stack.client()
    surrogate = chat_line(1)
    surrogate["body"]["messages"][0]["content"] = "\ud800"
    online = httpx.post(f"{batch_stack.edge.base_url}/chat/completions",
                        headers={"Authorization": f"Bearer {KEYS['tenant-a']}",
                                 "Content-Type": "application/json"},
                        # compact, as a line's body is sent (the byte offset matches)
                        content=json.dumps(surrogate["body"], separators=(",", ":")),
                        timeout=30)
    b = c.batches.create(input_file_id=upload(c, [chat_line(0), surrogate]).id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_stack.wait_batch(c, b.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
        "completed", 1, 1)
    err = json.loads(c.files.content(done.error_file_id).text)
    assert err["response"]["status_code"] == online.status_code == 400
    assert err["response"]["body"] == online.json()
    line = json.dumps(chat_line(2))
    raw = "\n".join([line.replace('"model": ', '"model": "x", "model": ', 1),
                      line.replace('"max_tokens": 5', '"max_tokens": NaN'),
                      line.replace('"body": ', '"body": ' + "[" * 5000 + "]" * 5000 + ', "b": ')])
    f = c.files.create(file=("hostile.jsonl", raw.encode() + b"\n" + line.encode()[:-2]
                             + b'\xff"}'), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    done = batch_stack.wait_batch(c, b.id)
    assert done.status == "failed" and done.errors is not None
    assert [(e.code, e.line) for e in done.errors.data] == [("invalid_json_line", n)
                                                            for n in (1, 2, 3, 4)]
    assert "duplicate key 'model'" in done.errors.data[0].message
    assert done.errors.data[3].message == \
        f"Line 4 is not UTF-8 (byte {len(line) - 1} of the line)."

    deep = httpx.post(f"{batch_stack.edge.base_url}/batches",
                      headers={"Authorization": f"Bearer {KEYS['tenant-a']}",
                               "Content-Type": "application/json"},
                      content="[" * 5000 + "]" * 5000, timeout=30)
    assert deep.status_code == 400 and deep.json()["error"]["type"] == "invalid_request_error"
    assert c.batches.retrieve(b.id).status == "failed"  # the service still answers


def test_cancel_finalizes_with_unrun_lines_in_the_error_file(batch_stack: BatchStack) -> None:
    c = batch_stack.client()
    rows = [chat_line(i, max_tokens=200) for i in range(200)]
    b = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    batch_stack.wait_batch(c, b.id, until=lambda x: x.status == "in_progress")
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = batch_stack.wait_batch(c, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    n = done.request_counts
    assert n.completed + n.failed == n.total == 200
    ids: list[str] = []
    for fid in (done.output_file_id, done.error_file_id):
        if fid:
            ids += [json.loads(x)["custom_id"] for x in c.files.content(fid).text.splitlines()]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(200))
    errs = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errs} == {"batch_cancelled"}
    # cancelled at once (validating, or just after): the counts still add up
    b = c.batches.create(input_file_id=upload(c, rows[:20]).id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    c.batches.cancel(b.id)
    n = batch_stack.wait_batch(c, b.id).request_counts
    assert n.completed + n.failed == n.total == 20


def test_the_batch_pages_example_runs_as_written(batch_stack: BatchStack,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = code_block("api/batch.md", "python") \
        .replace("http://127.0.0.1:8080/v1", batch_stack.edge.base_url) \
        .replace("tg-demo-key", KEYS["tenant-a"])
    exec(compile(code, "docs/api/batch.md", "exec"), {})  # noqa: S102
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("completed ")
    assert [line.split()[0] for line in out[1:]] == ["q-0", "q-1", "q-2"]
