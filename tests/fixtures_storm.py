"""TokenStorm fixtures: the fast upstream (nginx + Lua), its files under the checkout's var/.

Ports: 18100 (no latency: the null server), 18101 (TTFT 40 ms, ITL 2 ms), both shifted
by ``TOKENGATE_TEST_PORT_OFFSET`` like the other fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tokengate import config as tg_config
from tokengate_dev import devstack
from tokenstorm.null_server import FastUpstream
from tokenstorm.prompts import PromptBuilder
from tokenstorm.upstream import UpstreamOptions

from tests.conftest import PORT_OFFSET

FAST_PORT = 18100 + PORT_OFFSET
SLOW_PORT = 18101 + PORT_OFFSET


@pytest.fixture(scope="session")
def fast_upstream_url(cfg: tg_config.Config) -> Iterator[str]:
    """Base URL (…/v1) of the fast upstream with no simulated latency."""
    model = cfg.models["tiny-qwen3"]
    opts = UpstreamOptions(model=model.name, max_model_len=model.max_model_len)
    with FastUpstream(opts, port=FAST_PORT, name=f"test-fast-upstream{PORT_OFFSET or ''}",
                      state_dir=devstack.VAR) as up:
        yield up.url


@pytest.fixture(scope="session")
def slow_upstream_url(cfg: tg_config.Config) -> Iterator[str]:
    """Base URL of a fast upstream with TTFT 40 ms and ITL 2 ms."""
    model = cfg.models["tiny-qwen3"]
    opts = UpstreamOptions(model=model.name, max_model_len=model.max_model_len, ttft_ms=40,
                           itl_ms=2)
    with FastUpstream(opts, port=SLOW_PORT, name=f"test-slow-upstream{PORT_OFFSET or ''}",
                      state_dir=devstack.VAR) as up:
        yield up.url


@pytest.fixture(scope="session")
def prompt_builder(cfg: tg_config.Config) -> PromptBuilder:
    model = cfg.models["tiny-qwen3"]
    return PromptBuilder(model.dir, model.name, "chat")
