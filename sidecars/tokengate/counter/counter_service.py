"""gRPC servicer of ``tokengate.v1.TokenCounter`` (proto/tokengate/v1/counter.proto)."""

from __future__ import annotations

import json
import logging
from typing import Any, NoReturn

import grpc

from tokengate.counter.counting import BadRequest, ModelCounter
from tokengate.v1 import counter_pb2, counter_pb2_grpc

_MAX_DETAILS = 512  # characters of an error message sent back

log = logging.getLogger(__name__)
_ENDPOINTS = {counter_pb2.ENDPOINT_CHAT: "chat", counter_pb2.ENDPOINT_COMPLETIONS: "completions"}


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                 message: str) -> NoReturn:
    """Abort the RPC with a short, always-encodable message.

    Details travel as a UTF-8 header: a lone surrogate echoed from the body (a model
    named "\\ud800") cannot be encoded, and grpc then never sends the status at all.
    """
    if len(message) > _MAX_DETAILS:
        message = message[:_MAX_DETAILS] + "..."
    await context.abort(code, message.encode("utf-8", "backslashreplace").decode("utf-8"))
    raise AssertionError("context.abort returned")


class TokenCounterService(counter_pb2_grpc.TokenCounterServicer):
    """Counts prompt tokens for the configured models (one ``ModelCounter`` each)."""

    def __init__(self, counters: dict[str, ModelCounter]) -> None:
        self.counters = counters

    async def CountTokens(self, request: counter_pb2.CountRequest,
                          context: grpc.aio.ServicerContext) -> counter_pb2.CountReply:
        """Exact prompt tokens of ``request.body``.

        Errors: INVALID_ARGUMENT "<field path>: <problem>" (bad JSON, bad field, unknown
        endpoint); NOT_FOUND for a model that is not configured.
        """
        endpoint = _ENDPOINTS.get(request.endpoint)
        if endpoint is None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                "endpoint: expected ENDPOINT_CHAT or ENDPOINT_COMPLETIONS")
        try:
            body: Any = json.loads(request.body)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"body: invalid JSON: {e}")
        if not isinstance(body, dict):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                "body: expected a JSON object")
        model = request.model or body.get("model")
        if not isinstance(model, str) or not model:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "model: required string")
        counter = self.counters.get(model)
        if counter is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND,
                                f"model: the model '{model}' does not exist")
        try:
            r = counter.count(endpoint, body)
        except BadRequest as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RecursionError:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "body: nested too deeply")
        except Exception:  # a bug must cost one request, not the worker
            log.exception("CountTokens failed on a %d-byte body", len(request.body))
            await _abort(context, grpc.StatusCode.INTERNAL, "counter failed on this body")
        b = r.breakdown
        return counter_pb2.CountReply(
            prompt_tokens=r.prompt_tokens, max_model_len=r.max_model_len,
            max_tokens_effective=r.max_tokens_effective,
            max_tokens_requested=r.max_tokens_requested,
            breakdown=counter_pb2.Breakdown(system=b.system, tools=b.tools,
                                            messages=b.messages,
                                            template_overhead=b.template_overhead),
            tokenizer_fingerprint=counter.fingerprint,
            tokenizer_backend=counter.tokenizer.backend,
            prompt_count=r.prompt_count)
