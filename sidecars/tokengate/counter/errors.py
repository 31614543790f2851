"""The counter's one refusal: a body that is not a valid request for its endpoint."""

from __future__ import annotations


class BadRequest(ValueError):
    """The body is not a valid request; ``param`` is the offending field's path."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message
