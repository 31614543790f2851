"""A vLLM logits processor for the agent tests: every answer ends its turn after a few tokens.

The embedded tiny model has random weights: its next token is close to uniform over
151,936 ids, so it practically never emits ``<|im_end|>`` and every answer runs to its
``max_tokens`` (``finish_reason: length``, Anthropic ``stop_reason: max_tokens``). Codex
CLI takes such an answer as the turn's end; Claude Code does not: it retries with
``max_tokens`` raised to 128,000 and "Output token limit hit. Resume directly", three
times, then exits 1 ("API Error: Claude's response exceeded the 128000 output token
maximum"). A real model ends its turn; this processor makes the tiny one do so after
``TOKENGATE_TEST_END_TURN_AFTER`` generated tokens (default 8) by leaving only the
request's stop tokens (``SamplingParams.all_stop_token_ids``: the model's EOS and the
generation config's) possible, so the answer finishes with ``stop`` / ``end_turn`` and
what vLLM counts and reports is otherwise unchanged.

Loaded by the agents' vLLM server (tests/fixtures_agents.py) with
``--logits-processors tests.end_turn_logits:EndTurnAfter`` and the checkout on
PYTHONPATH; the interface is vLLM 0.32's ``vllm/v1/sample/logits_processor/interface.py``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

END_TURN_ENV = "TOKENGATE_TEST_END_TURN_AFTER"


class EndTurnAfter(LogitsProcessor):
    """After ``TOKENGATE_TEST_END_TURN_AFTER`` output tokens a request may only emit one
    of its stop tokens (batch index -> (output tokens so far, stop ids))."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.after = int(os.environ.get(END_TURN_ENV, "8"))
        self.reqs: dict[int, tuple[Sequence[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    @staticmethod
    def _add(params: SamplingParams, _prompt: list[int] | None,
             output: list[int]) -> tuple[Sequence[int], list[int]] | None:
        stops = sorted(params.all_stop_token_ids)
        return (output, stops) if stops else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.reqs, batch_update, self._add)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (output, stops) in self.reqs.items():
            if len(output) >= self.after:
                row = logits[index]
                keep = row[stops].clone()
                row.fill_(-float("inf"))
                row[stops] = keep
        return logits
