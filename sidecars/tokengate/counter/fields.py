"""A request body's optional fields, read as vLLM 0.32's pydantic request models read
them (lax mode): shared by ``counting`` and the API modules of ``tokengate.counter.apis``.
Each raises ``BadRequest`` naming the field."""

from __future__ import annotations

from typing import Any

from tokengate.counter.errors import BadRequest, type_name

# reasoning effort (chat's reasoning_effort, Responses' reasoning.effort): the literal of
# vLLM 0.32's ChatCompletionRequest and of openai's ReasoningEffort, which its
# ResponsesRequest uses; another value was refused there after admission
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    """An optional integer field (None: absent or null); integral floats (16.0, 1e1)
    count as integers, as in vLLM's pydantic models (lax mode); below ``minimum``
    refused."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(key, f"expected an integer, got {type_name(v)}")
    if v < minimum:
        raise BadRequest(key, f"must be at least {minimum}, got {v}")
    return v


def opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    """An optional boolean field; ``default`` when absent or null."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(key, f"expected a boolean, got {type_name(v)}")
    return v


def opt_choice(body: dict[str, Any], key: str, choices: tuple[str, ...]) -> str | None:
    """An optional field that is one of ``choices`` (None: absent or null), as vLLM's
    ``Literal`` fields."""
    v = body.get(key)
    if v is None or (isinstance(v, str) and v in choices):
        return v
    got = repr(v) if isinstance(v, str) else type_name(v)
    raise BadRequest(key, f"expected one of {', '.join(map(repr, choices))}, got {got}")
