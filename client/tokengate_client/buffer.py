"""The adaptive streaming buffer: a stream's text deltas regrouped into readable pieces.

Rendering every delta (terminals, web sockets, text to speech) costs a write per token;
waiting for the whole answer throws the stream away. The buffer holds text until one of:

- a sentence end: Latin ``.``, ``!``, ``?`` followed by white space (``3.14`` and ``e.g.``
  inside a sentence do not end it), or CJK and full-width ``。！？；．…`` (no space
  follows them), each with the closing quotes and brackets right after it;
- a newline;
- ``size`` characters: ``min(4096, max(256, expected_tokens / 16))``, after the system
  this SDK follows, so that long answers come in longer pieces;
- ``first_piece_s`` since the first text arrived, for the first piece only, so that
  buffering never delays the start of an answer by more than that;
- the end of the stream.

A piece ends at the last such boundary in the buffer (sentence ends and newlines), the
rest stays for the next. Concatenated, the pieces are exactly the deltas' text.
"""

from __future__ import annotations

import re

MIN_SIZE, MAX_SIZE, TOKENS_PER_CHAR = 256, 4096, 16
_CLOSERS = "\"'\u201d\u2019)\\]}\u00bb\u300d\u300f\uff09\u3011"
_BOUNDARY = re.compile(
    "\n"
    f"|[\u3002\uff01\uff1f\uff1b\uff0e\u2026]+[{_CLOSERS}]*"
    f"|[.!?]+[{_CLOSERS}]*(?=\\s)")


def buffer_size(expected_tokens: int) -> int:
    """Characters the buffer holds at most: ``min(4096, max(256, expected_tokens /
    16))``, ``expected_tokens`` being the completion budget (tokens)."""
    return min(MAX_SIZE, max(MIN_SIZE, expected_tokens // TOKENS_PER_CHAR))


class TextBuffer:
    """Regroups text deltas into pieces (see the module's rules). Pure: times are given
    by the caller (seconds, any monotonic clock).

    ``feed(text, now)`` and ``due(now)`` return the next piece or None; ``deadline()`` is
    when ``due`` will have one (None: no time bound pending); ``end()`` returns what is
    left when the stream ends.
    """

    def __init__(self, size: int, first_piece_s: float) -> None:
        if size < 1 or first_piece_s < 0:
            raise ValueError("size must be >= 1 and first_piece_s >= 0")
        self.size = size
        self.first_piece_s = first_piece_s
        self._text = ""
        self._first_at: float | None = None  # when the first piece's text arrived
        self._first_out = False

    def deadline(self) -> float | None:
        if self._first_out or self._first_at is None:
            return None
        return self._first_at + self.first_piece_s

    def _take(self, n: int) -> str:
        piece, self._text = self._text[:n], self._text[n:]
        self._first_out = True
        return piece

    def feed(self, text: str, now: float) -> str | None:
        """Adds a delta's text; returns a piece when a boundary, the size or the first
        piece's time bound says so."""
        if not text:
            return self.due(now)
        if self._first_at is None:
            self._first_at = now
        self._text += text
        end = 0
        for m in _BOUNDARY.finditer(self._text):
            end = m.end()
        if end:
            return self._take(end)
        if len(self._text) >= self.size:
            return self._take(len(self._text))
        return self.due(now)

    def due(self, now: float) -> str | None:
        """The first piece, once its time bound has passed and it holds text."""
        deadline = self.deadline()
        if deadline is not None and now >= deadline and self._text:
            return self._take(len(self._text))
        return None

    def end(self) -> str | None:
        """What is left (the stream ended)."""
        return self._take(len(self._text)) if self._text else None
