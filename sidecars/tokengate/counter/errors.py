"""The counter's refusals: a body that is not a valid request for its endpoint (and, a
kind of it, a prompt longer than the model's context), and the two checks every API
module (``tokengate.counter.apis``) words its refusals with, and the check of a field
that names one of a few kinds (a role, a block type)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


class BadRequest(ValueError):
    """The body is not a valid request; ``param`` is the offending field's path."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message


class ContextLengthExceeded(BadRequest):
    """A prompt is longer than the model's context (``max_model_len``), which vLLM
    refuses before running anything; ``param`` names the prompt (``input[2]``). The
    counter answers it with gRPC OUT_OF_RANGE, which the edge turns into 400
    ``context_length_exceeded``."""


def type_name(v: Any) -> str:
    """A parsed JSON value's type as a refusal names it ("an object", "null", ...)."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v), "a value")


def expect(where: str, v: Any, kinds: tuple[type, ...], what: str) -> None:
    """``BadRequest(where, "expected <what>, got <type>")`` unless ``v`` is one of
    ``kinds`` (a JSON boolean is no integer unless ``bool`` is listed)."""
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise BadRequest(where, f"expected {what}, got {type_name(v)}")


def expect_name(where: str, v: Any, names: Collection[str], what: str) -> str:
    """``v``, a string among ``names``: ``BadRequest(where, "required string")`` when it is
    not a string, ``BadRequest(where, "unknown <what> <v!r>; expected one of <names>")``
    when it is none of them (a set's names sorted, a sequence's in its order)."""
    if not isinstance(v, str):
        raise BadRequest(where, "required string")
    if v not in names:
        listed = sorted(names) if isinstance(names, (set, frozenset)) else names
        raise BadRequest(where, f"unknown {what} {v!r}; expected one of " + ", ".join(listed))
    return v
