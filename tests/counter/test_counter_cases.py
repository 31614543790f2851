"""The parity tests' case lists cover their contracts: each at least as many cases as
its contract asks, each name once, and every case the contract names among them (the
parity tests compare each case's count with vLLM's own)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests import counter_cases, counter_messages_cases, counter_responses_cases
from tests.conftest import assert_cases_cover


@pytest.mark.unit
@pytest.mark.parametrize("cases,at_least", [(counter_cases, 60), (counter_messages_cases, 50),
                                            (counter_responses_cases, 50)],
                         ids=["chat and completions", "messages", "responses"])
def test_each_parity_case_list_covers_its_contract(cases: ModuleType, at_least: int) -> None:
    assert_cases_cover(cases.CASES, at_least, getattr(cases, "NAMED", ()))
