"""Bad bodies get INVALID_ARGUMENT naming the field; nothing crashes the counter. Over
gRPC (TCP) and in counter frames (the workers' unix sockets, the edge's transport) alike;
a frame that is none is refused and the worker keeps serving."""

from __future__ import annotations

import json
import random
import socket
import struct

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokengate.counter import frames
from tokengate.counter.counter_service import CountFailure
from tokengate.v1 import counter_pb2, counter_pb2_grpc

from tests.conftest import MODEL, TEST_DIR, read_until_closed
from tests.counter_cases import CASES

CHAT = counter_pb2.ENDPOINT_CHAT
COMPLETIONS = counter_pb2.ENDPOINT_COMPLETIONS


def error_of(counter_stub: counter_pb2_grpc.TokenCounterStub, body: bytes | dict,
             endpoint: int = CHAT, model: str = "") -> tuple[grpc.StatusCode, str]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(grpc.RpcError) as info:
        counter_stub.CountTokens(counter_pb2.CountRequest(model=model, endpoint=endpoint, body=raw))
    return info.value.code(), info.value.details()


def msgs(*m: object) -> dict:
    return {"model": MODEL, "messages": list(m)}


BAD_CHAT = [
    (b"{not json", "body: invalid JSON"),
    (b"[1, 2]", "body: expected a JSON object"),
    (b"\xff\xfe{}", "body: invalid JSON"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model: required string"),
    ({"model": MODEL}, "messages: expected a non-empty array"),
    (msgs(), "messages: expected a non-empty array"),
    ({"model": MODEL, "data": {"messages": [{"role": "user", "content": "x"}]}},
     "messages: expected a non-empty array"),
    (msgs("hello"), "messages[0]: expected an object, got a string"),
    (msgs({"content": "x"}), "messages[0].role: required string"),
    (msgs({"role": "wizard", "content": "x"}), "messages[0].role: unknown role 'wizard'"),
    (msgs({"role": "user", "content": "a"}, {"role": "user", "content": 5}),
     "messages[1].content: expected a string or an array of content parts, got an integer"),
    (msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
     "messages[0].content[0].type: content part type 'image_url' is not supported"),
    (msgs({"role": "user", "content": [{"text": "x"}]}), "messages[0].content[0].type: required"),
    (msgs({"role": "user", "content": [{"type": "text", "text": ["x"]}]}),
     "messages[0].content[0].text: expected a string, got an array"),
    # what vLLM 0.32 refuses after admission with a pydantic dump (measured on its server)
    (msgs({"role": "user", "content": [{"type": "text"}]}),
     "messages[0].content[0].text: required string for 'text' parts"),
    (msgs({"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}),
     "messages[0].content[0].refusal: required string for 'refusal' parts"),
    (msgs({"role": "system", "content": None}, {"role": "user", "content": "x"}),
     "messages[0].content: expected a string or an array of content parts, got null"),
    (msgs({"role": "tool", "content": None, "tool_call_id": "c"}),
     "messages[0].content: expected a string or an array of content parts, got null"),
    (msgs({"role": "user", "content": "x", "name": None}),
     "messages[0].name: expected a string, got null"),
    (msgs({"role": "user", "content": "x", "name": 5}),
     "messages[0].name: expected a string, got an integer"),
    ({**msgs({"role": "user", "content": "x"}), "reasoning_effort": "ultra"},
     "reasoning_effort: expected one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh'"),
    ({**msgs({"role": "user", "content": "x"}), "documents": "x"},
     "documents: expected an array of objects whose values are strings"),
    ({**msgs({"role": "user", "content": "x"}), "documents": [{"title": "t", "n": 1}]},
     "documents: expected an array of objects whose values are strings"),
    (msgs({"role": "user", "content": ["ok", 3]}),
     "messages[0].content[1]: expected an object, got an integer"),
    (msgs({"role": "assistant", "content": None, "tool_calls": {"a": 1}}),
     "messages[0].tool_calls: expected an array"),
    (msgs({"role": "assistant", "content": None, "tool_calls": ["x"]}),
     "messages[0].tool_calls[0]: assistant tool_calls entries must be objects"),
    (msgs({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 1}}]}),
     "messages[0].tool_calls[0].function.name: required string"),
    (msgs({"role": "assistant", "tool_calls": [{"type": "custom", "custom": {}}]}),
     "messages[0].tool_calls[0]: only tool_calls of type 'function'"),
    ({**msgs({"role": "user", "content": "x"}), "tools": {"a": 1}}, "tools: expected an array"),
    ({**msgs({"role": "user", "content": "x"}), "tools": [{"type": "function"}]},
     "tools[0].function: required object"),
    ({**msgs({"role": "user", "content": "x"}),
      "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters: expected an object"),
    ({**msgs({"role": "user", "content": "x"}), "max_tokens": 0},
     "max_tokens: must be at least 1, got 0"),
    ({**msgs({"role": "user", "content": "x"}), "max_tokens": 2**70},
     "max_tokens: 1180591620717411303424 is greater than max_model_len 8192"),
    ({**msgs({"role": "user", "content": "x"}), "max_completion_tokens": 8193},
     "max_completion_tokens: 8193 is greater than max_model_len 8192"),
    ({**msgs({"role": "user", "content": "x"}), "max_tokens": "10"},
     "max_tokens: expected an integer, got a string"),
    ({**msgs({"role": "user", "content": "x"}), "max_completion_tokens": -5},
     "max_completion_tokens: must be at least 1"),
    ({**msgs({"role": "user", "content": "x"}), "chat_template_kwargs": {"truncation": True}},
     "chat_template_kwargs.truncation: not allowed"),
    ({**msgs({"role": "user", "content": "x"}), "chat_template_kwargs": []},
     "chat_template_kwargs: expected an object"),
    # the edge's allowlist (edge.chat_template_kwargs_allowed): "tools" there would render
    # as tools past every check of the request's own tools
    ({**msgs({"role": "user", "content": "x"}), "chat_template_kwargs": {"tools": []}},
     ("chat_template_kwargs.tools: not an allowed chat template argument (allowed: "
      "enable_thinking, reasoning_effort)")),
    ({**msgs({"role": "user", "content": "x"}), "chat_template_kwargs": {"foo": "bar"}},
     "chat_template_kwargs.foo: not an allowed chat template argument"),
    ({**msgs({"role": "user", "content": "x"}), "chat_template": "{{ 'x' }}"},
     "chat_template: request-provided chat templates are not allowed"),
    ({**msgs({"role": "user", "content": "x"}), "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message: cannot set both"),
    ({**msgs({"role": "user", "content": "x"}), "add_generation_prompt": "yes"},
     "add_generation_prompt: expected a boolean"),
    ({**msgs({"role": "user", "content": "x"}), "truncate_prompt_tokens": 9000},
     "truncate_prompt_tokens: 9000 is greater than max_model_len 8192"),
    (json.dumps(msgs({"role": "user", "content": "x"})).encode()[:-1] + b"," + b"[" * 200
     + b"]" * 200 + b"}", "body: invalid JSON"),
]


@pytest.mark.parametrize("body,message", BAD_CHAT, ids=[m for _, m in BAD_CHAT])
def test_bad_chat_body_is_invalid_argument(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                           body: bytes | dict, message: str) -> None:
    code, details = error_of(counter_stub, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(message), details


BAD_COMPLETIONS = [
    ({"model": MODEL}, "prompt: required"),
    ({"model": MODEL, "prompt": 5}, "prompt: expected a string, an array of strings"),
    ({"model": MODEL, "prompt": []}, "prompt: expected a string, an array of strings"),
    ({"model": MODEL, "prompt": [1, -2]}, "prompt[1]: token id -2 is out of vocabulary"),
    ({"model": MODEL, "prompt": [1, 10_000_000]}, "prompt[1]: token id 10000000 is out of"),
    ({"model": MODEL, "prompt": ["ok", {"a": 1}]}, "prompt[1]: expected a string or a"),
    ({"model": MODEL, "prompt": [[1], []]}, "prompt[1]: expected a string or a"),
    ({"model": MODEL, "prompt": [True, False]}, "prompt[0]: expected a string or a"),
    # what vLLM 0.32 refuses after admission
    ({"model": MODEL, "prompt": ""}, "prompt: empty: a prompt needs at least one token"),
    ({"model": MODEL, "prompt": ["a", ""]}, "prompt[1]: empty: a prompt needs at least one"),
    ({"model": MODEL, "prompt": "x", "suffix": 5}, "suffix: not supported"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix: not supported"),
]


@pytest.mark.parametrize("body,message", BAD_COMPLETIONS, ids=[m for _, m in BAD_COMPLETIONS])
def test_bad_completions_body_is_invalid_argument(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                                  body: dict, message: str) -> None:
    code, details = error_of(counter_stub, body, COMPLETIONS)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(message), details


def test_unknown_model_is_not_found(counter_stub: counter_pb2_grpc.TokenCounterStub) -> None:
    x = [{"role": "user", "content": "x"}]
    assert error_of(counter_stub, {"model": "gpt-9", "messages": x}) \
        == (grpc.StatusCode.NOT_FOUND, "model: the model 'gpt-9' does not exist")
    code, _ = error_of(counter_stub, {"messages": x}, model="gpt-9")
    assert code == grpc.StatusCode.NOT_FOUND
    # A lone surrogate echoed into the status message must not stall the RPC.
    code, details = error_of(counter_stub, {"model": "\ud800", "messages": []})
    assert (code, details) == (grpc.StatusCode.NOT_FOUND,
                               "model: the model '\\ud800' does not exist")
    assert code == grpc.StatusCode.NOT_FOUND


def test_unspecified_endpoint_is_invalid_argument(
        counter_stub: counter_pb2_grpc.TokenCounterStub) -> None:
    code, details = error_of(counter_stub, msgs({"role": "user", "content": "x"}),
                             counter_pb2.ENDPOINT_UNSPECIFIED)
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               ("endpoint: expected one of ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, "
                                "ENDPOINT_MESSAGES, ENDPOINT_MESSAGES_COUNT_TOKENS, "
                                "ENDPOINT_RESPONSES, ENDPOINT_EMBEDDINGS"))


def mutate(rng: random.Random, value: object, depth: int = 0) -> object:
    """A random structural corruption of a JSON value."""
    choices = [None, True, 0, -1, 2**70, 1.5, "", "x" * rng.randint(0, 50), [], {},
               [None], {"type": None}, "<|im_end|>", "\ud800"]
    if isinstance(value, dict) and value and depth < 6:
        k = rng.choice(list(value))
        out = dict(value)
        out[k] = mutate(rng, value[k], depth + 1) if rng.random() < 0.7 else rng.choice(choices)
        return out
    if isinstance(value, list) and value and depth < 6:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        out_list[i] = mutate(rng, out_list[i], depth + 1)
        return out_list
    return rng.choice(choices)


def test_fuzzed_bodies_never_crash_the_counter(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                               counter_addr: str) -> None:
    """2,000 corrupted copies of the parity bodies: each answer is a count or a 4xx-class
    status (INVALID_ARGUMENT / NOT_FOUND), never UNKNOWN/INTERNAL, and the server lives."""
    rng = random.Random(1129)
    endpoints = {"chat": CHAT, "completions": COMPLETIONS}
    outcomes: dict[str, int] = {}
    for i in range(2000):
        _, endpoint, body = CASES[i % len(CASES)]
        mutated = mutate(rng, {"model": MODEL, **body})
        raw = json.dumps(mutated).encode("utf-8", "surrogatepass")
        if i % 7 == 0:
            cut = rng.randrange(len(raw))
            raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
        try:
            counter_stub.CountTokens(counter_pb2.CountRequest(endpoint=endpoints[endpoint],
                                                              body=raw))
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = e.code().name
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert set(outcomes) <= {"OK", "INVALID_ARGUMENT", "NOT_FOUND"}, outcomes
    assert outcomes.get("INVALID_ARGUMENT", 0) > 100
    with grpc.insecure_channel(counter_addr) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tokengate.v1.TokenCounter"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_health_and_reflection_are_served(counter_addr: str) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(counter_addr) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert {"tokengate.v1.TokenCounter", "grpc.health.v1.Health"} <= services
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def frames_result(c: frames.Client, request: counter_pb2.CountRequest) -> object:
    try:
        return c.count(request)
    except CountFailure as e:
        return e.code, e.message


def grpc_result(counter_stub: counter_pb2_grpc.TokenCounterStub,
                request: counter_pb2.CountRequest) -> object:
    try:
        return counter_stub.CountTokens(request)
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_counter_frames_answer_what_grpc_answers(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                                 counter_addr: str) -> None:
    requests = [counter_pb2.CountRequest(endpoint=CHAT, body=json.dumps(
        msgs({"role": "user", "content": "hi"})).encode())]
    requests += [counter_pb2.CountRequest(endpoint=CHAT, body=b if isinstance(b, bytes)
                                          else json.dumps(b).encode()) for b, _ in BAD_CHAT]
    requests += [counter_pb2.CountRequest(endpoint=CHAT, body=json.dumps(
                     {"model": "\ud800", "messages": []}).encode()),
                 counter_pb2.CountRequest(endpoint=counter_pb2.ENDPOINT_UNSPECIFIED,
                                          body=b"{}")]
    for i in range(2):
        with frames.Client(str(TEST_DIR / f"counter.sock.{i}")) as c:
            got = [frames_result(c, r) for r in requests]
        assert got == [grpc_result(counter_stub, r) for r in requests]
    assert got[0].prompt_tokens == 9  # type: ignore[attr-defined]
    assert got[-2] == (grpc.StatusCode.NOT_FOUND, "model: the model '\\ud800' does not exist")


def raw_reply(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """(status, message, what follows: b"" when the counter closed the connection)."""
    data = read_until_closed(sock)
    status, _, n = struct.unpack(">BBI", data[:6])
    return status, data[6:6 + n], data[6 + n:]


@pytest.mark.parametrize("frame,message", [
    (b"\x01\x00\x00\x00\x02{}", b"request: compressed"),
    (b"\x00\x7f\xff\xff\xff", b"request: larger than 64 MiB"),
])
def test_a_frame_that_is_none_is_refused_and_the_worker_keeps_serving(
        counter_addr: str, frame: bytes, message: bytes) -> None:
    path = str(TEST_DIR / "counter.sock.0")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(frame)
        # answered, then closed: what follows a length it cannot trust is no request
        assert raw_reply(sock) == (3, message, b"")
    with frames.Client(path) as c:
        assert c.send(b"\xff\xff") == (3, b"request: not a CountRequest")
        assert c.count(counter_pb2.CountRequest(endpoint=CHAT, body=json.dumps(
            msgs({"role": "user", "content": "hi"})).encode())).prompt_tokens == 9
