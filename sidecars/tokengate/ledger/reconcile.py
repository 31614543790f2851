"""Joining an edge usage event with its engine usage records, and what the request is
billed (the ledger applies the result, ``tokengate.ledger.ledger``).

An edge request becomes one or more engine requests, each named by vLLM's external id
with the edge's request id inside (``tokengate.ledger.engine_record``):

- a chat completion is one engine request ``chatcmpl-<id>``;
- a completions request with k prompts is k engine requests ``cmpl-<id>-0`` ..
  ``cmpl-<id>-<k-1>`` (vllm/entrypoints/openai/completion/serving.py), and a chat
  with several engine inputs ``chatcmpl-<id>_<i>`` the same way;
- an ``n > 1`` request is n children of each engine request, one record each
  (``index`` 0..n-1, vllm/v1/engine/parallel_sampling.py).

How many records to expect is therefore known from the records themselves except for
the number of prompts, which the usage event does not carry. The engine side of an
event is **complete** when every engine request seen has all its n children and

- the ids carry no prompt suffix (one engine request), or
- the prompt suffixes seen are exactly 0..k-1 and the prompts add up to the edge's
  count of the whole request: ``token_estimate`` when the counter counted it
  (``count_source: "counter"``, the number vLLM reports, DESIGN.md §2.1), else
  ``prompt_tokens`` of a final usage; with neither, the suffixes alone decide.

An incomplete engine side waits (``ledger.engine_wait_s``) and is then billed with the
records that arrived (``settle_engine(..., complete=False)``), or with the edge's
numbers when none did (``settle_edge``).

What the engine's records bill (the counting rules of ``tokengate_vllm.record``):

    prompt_tokens      Σ over engine requests of num_prompt_tokens, once per engine
                       request (its children share the prompt), and only when one of
                       its children was prefilled: vllm:prompt_tokens_total counts a
                       prompt when the engine computed it, once per child
    completion_tokens  Σ over every record of num_generation_tokens (=
                       vllm:generation_tokens_total's growth)
    cached_tokens      Σ over engine requests of num_cached_tokens of the lowest-index
                       prefilled child (the prefix-cache hits of the first
                       computation of that prompt)

A request that left while it waited in vLLM's queue (no child prefilled) is billed
nothing: the engine computed nothing for it.

The edge's numbers and the engine's are compared only where both describe a whole
response: a request that was not ``client_aborted`` and whose usage is ``final``. A
difference in prompt or completion tokens is a disagreement (counted, logged); the
engine's numbers are billed either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from tokengate.ledger.engine_record import EngineRecord
from tokengate.ledger.event import UsageEvent

ENGINE = "engine"
EDGE = "edge"

# "<prefix>-<32 hex>" optionally followed by "-<i>" (completions prompt i) or "_<i>"
_PROMPT_SUFFIX = re.compile(r"[a-z]+-[0-9a-f]{32}[-_](\d+)")


@dataclass(frozen=True, slots=True)
class Settlement:
    """What one edge request is billed (tokens) and how that was decided."""

    by: str                       # "engine" (its records) | "edge" (the usage event)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    records: int                  # engine records used, 0 when by == "edge"
    complete: bool                # False: billed at the end of the wait with what arrived
    disagreement: str | None      # "prompt 12 != 13" ... (edge != engine), else None


def waits_for_engine(ev: UsageEvent) -> bool:
    """Whether an event can have engine records: vLLM answered with usage, or the edge
    estimated a request it forwarded (``usage_source`` other than ``"none"``; "none" is
    a request the edge refused or vLLM rejected before it reached the engine)."""
    return ev.usage_source != "none"


def prompt_index(request_id: str) -> int | None:
    """The prompt suffix of an engine request id (``cmpl-<id>-2`` -> 2), None without."""
    m = _PROMPT_SUFFIX.fullmatch(request_id)
    return int(m.group(1)) if m else None


def engine_requests(records: Iterable[EngineRecord]) -> dict[str, dict[int, EngineRecord]]:
    """Records by engine request id, then by child index (the first record of a key
    wins: replays are never counted twice)."""
    out: dict[str, dict[int, EngineRecord]] = {}
    for r in records:
        out.setdefault(r.request_id, {}).setdefault(r.index, r)
    return out


def expected_prompt_tokens(ev: UsageEvent) -> int | None:
    """The edge's count of the whole request's prompt tokens, when it has one."""
    if ev.count_source == "counter" and ev.token_estimate > 0:
        return ev.token_estimate
    if ev.usage_source == "final" and ev.prompt_tokens > 0:
        return ev.prompt_tokens
    return None


def _prompt(children: dict[int, EngineRecord]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) billed for one engine request."""
    pre = [children[i] for i in sorted(children) if children[i].prefilled]
    if not pre:
        return 0, 0
    return pre[0].num_prompt_tokens, pre[0].num_cached_tokens


def is_complete(ev: UsageEvent, records: Iterable[EngineRecord]) -> bool:
    """Whether ``records`` are every engine record of ``ev`` (module docstring)."""
    reqs = engine_requests(records)
    if not reqs:
        return False
    for children in reqs.values():
        n = max(r.n for r in children.values())
        if len(children) != n:
            return False
    suffixes = [prompt_index(rid) for rid in reqs]
    numbered = sorted(s for s in suffixes if s is not None)
    if not numbered:
        return len(reqs) == 1
    if numbered != list(range(len(reqs))):  # a gap, or ids with and without a suffix
        return False
    want = expected_prompt_tokens(ev)
    if want is None:
        return True
    return sum(next(iter(c.values())).num_prompt_tokens for c in reqs.values()) == want


def settle_engine(ev: UsageEvent, records: Iterable[EngineRecord],
                  complete: bool = True) -> Settlement:
    """Bill ``ev`` with its engine records (module docstring); compares the two where
    both describe a whole response."""
    reqs = engine_requests(records)
    prompt = cached = completion = count = 0
    for children in reqs.values():
        p, c = _prompt(children)
        prompt += p
        cached += c
        completion += sum(r.num_generation_tokens for r in children.values())
        count += len(children)
    diff = None
    if not ev.client_aborted and ev.usage_source == "final":
        parts = [f"{name} {edge} (edge) != {eng} (engine)"
                 for name, edge, eng in (("prompt", ev.prompt_tokens, prompt),
                                         ("completion", ev.completion_tokens, completion))
                 if edge != eng]
        diff = ", ".join(parts) or None
    return Settlement(ENGINE, prompt, completion, cached, count, complete, diff)


def settle_edge(ev: UsageEvent) -> Settlement:
    """Bill ``ev`` with its own numbers (the rule without engine records:
    docs/operators/billing.md)."""
    return Settlement(EDGE, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, 0,
                      False, None)
