"""Counting a prompt assembled from a chat-template trace by its segments.

The tokenizer counts a prompt as the sum of its text pieces between added tokens
(``PromptTokenizer.split``), each looked up in the segment cache. A prompt assembled
from a trace (``template_trace``) is the template's fixed text with the message
contents in known places, so those pieces are known too: each is fixed text, or fixed
text around one content (Qwen3: ``"user\\n" + content`` between ``<|im_start|>`` and
``<|im_end|>``). A *segment plan* is that list, made once per trace. Counting by it
skips joining the prompt and cutting it again (``split`` runs a regex over the whole
history every turn), and the breakdown's tokens of a content are its piece's count less
the tokens of the fixed text around it, also known once per trace, instead of a search
for the content among the pieces.

Exact when the cut of the whole prompt is the cut of its parts, which holds when

- no added token can begin inside a content (``PromptTokenizer.inert``, checked for
  every content of every call: a call with one that is not inert, a content holding
  ``<|im_end|>`` for instance, is counted from its text), and
- no added token can begin in fixed text right before a content and run into it
  (``PromptTokenizer.may_run_on``, checked once: such a trace gets no plan).

Then every added token of the prompt lies inside fixed text, where cutting the fixed
text alone finds it. A trace gets no plan either when a message's content appears other
than once, out of order, or in the same piece as another content. Each plan is compared
once with the cut of the text of the first call it counts; a difference (which the
conditions above should make impossible) is logged and the trace keeps no plan.

The breakdown (``counting._tokens_inside`` on the cut text) is reproduced exactly: a
content's tokens are taken from its own piece only where that search would have found
it there (no earlier piece it searches holds the content, and the content is where the
search's ``endswith``/``rfind`` would put it); otherwise the caller runs the search.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from tokengate.counter.template_trace import Rendered, Trace
from tokengate.counter.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

_NO_PLAN = False  # Trace.plan of a trace that has none (None: not made yet)


class Segment(NamedTuple):
    """One text piece of the prompt: fixed text ``head``, the content of message
    ``slot`` (-1: none), fixed text ``tail``; ``rest``: tokens of ``head + tail``."""

    head: str
    slot: int
    tail: str
    rest: int


class SegmentPlan:
    """A trace's prompt as text pieces (``segments``) and the added tokens between
    them (``specials``: ``len(segments) - 1`` of them, one token each); ``own[i]``: the
    segment of message ``i``'s content."""

    def __init__(self, segments: list[Segment], specials: list[str], own: list[int]) -> None:
        self.segments = segments
        self.specials = specials
        self.own = own
        self.checked = False

    @classmethod
    def of(cls, trace: Trace, tok: PromptTokenizer) -> SegmentPlan | None:
        """The plan of ``trace`` for ``tok``, or None when the conditions in the module
        docstring do not hold for its fixed text."""
        pieces = trace.pieces
        slots = [p for p in pieces if isinstance(p, int)]
        if slots != list(range(len(slots))):
            return None
        found: list[tuple[str, int, str]] = []
        specials: list[str] = []
        head: list[str] = []
        tail: list[str] = []
        slot = -1
        for k, piece in enumerate(pieces):
            if isinstance(piece, int):
                before = pieces[k - 1] if k else ""
                if slot >= 0 or (isinstance(before, str) and tok.may_run_on(before)):
                    return None
                slot = piece
                continue
            for j, part in enumerate(tok.split(piece)):
                if j % 2:
                    found.append(("".join(head), slot, "".join(tail)))
                    specials.append(part)
                    head, tail, slot = [], [], -1
                elif part:
                    (tail if slot >= 0 else head).append(part)
        found.append(("".join(head), slot, "".join(tail)))
        segments = [Segment(h, s, t, tok.count(h + t) if s >= 0 else 0) for h, s, t in found]
        own = [0] * len(slots)
        for k, seg in enumerate(segments):
            if seg.slot >= 0:
                own[seg.slot] = k
        return cls(segments, specials, own)

    def texts(self, contents: list[str], tok: PromptTokenizer) -> list[str] | None:
        """The prompt's text pieces with ``contents`` in place, or None when one of them
        is not inert (the prompt must then be cut from its text)."""
        inert = tok.inert
        out: list[str] = []
        for head, slot, tail, _ in self.segments:
            if slot < 0:
                out.append(head)
                continue
            c = contents[slot]
            if not inert(c):
                return None
            out.append(head + c + tail if tail else head + c)
        return out

    def content_tokens(self, contents: list[str], texts: list[str],
                       counts: list[int]) -> list[int] | None:
        """Tokens of each message's content as ``counting._tokens_inside`` finds them
        in the cut prompt (``texts``, their ``counts``), messages in order; None where
        its search might land elsewhere than the content's own piece."""
        out: list[int] = []
        searched = 0  # the first piece the next search looks at
        for i, c in enumerate(contents):
            if not c:
                out.append(0)
                continue
            own = self.own[i]
            for j in range(searched, own):
                if c in texts[j]:
                    return None
            head, _, tail, rest = self.segments[own]
            text = texts[own]
            if tail and (text.endswith(c) or text.rfind(c) != len(head)):
                return None
            out.append(max(0, counts[own] - rest))
            searched = own + 1
        return out


def cut(rendered: Rendered, tok: PromptTokenizer) -> tuple[SegmentPlan, list[str]] | None:
    """The plan of ``rendered``'s trace and its text pieces for this call, or None when
    the prompt must be cut from its text: not assembled from a trace, a trace without
    a plan, or a content that is not inert. A plan's first use is checked against the
    cut of the text (see the module docstring)."""
    trace, contents = rendered.trace, rendered.contents
    if trace is None or contents is None or trace.plan is _NO_PLAN:
        return None
    plan = trace.plan
    if plan is None:
        plan = SegmentPlan.of(trace, tok)
        trace.plan = _NO_PLAN if plan is None else plan
        if plan is None:
            return None
    assert isinstance(plan, SegmentPlan)
    if len(contents) != len(plan.own):
        return None
    texts = plan.texts(contents, tok)
    if texts is None:
        return None
    if not plan.checked:
        parts = tok.split(rendered.text)
        if parts[0::2] != texts or parts[1::2] != plan.specials:
            log.warning("segment plan differs from the cut prompt for %d messages; that "
                        "trace is counted from its text", len(contents))
            trace.plan = _NO_PLAN
            return None
        plan.checked = True
    return plan, texts
