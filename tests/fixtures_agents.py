"""Fixtures of the agent tests (tests/edge/test_edge_agents.py): the real agent clients in
front of the real edge, counter and vLLM CPU server.

- ``agent_tools``: where ``make setup`` installed the clients (``.venv/.agents``: Codex CLI
  and Claude Code from dev/agents/package-lock.json, the Agents SDK and LangChain in a
  virtualenv of their own).
- ``agents_stack``: an edge, a counter and a vLLM server whose context holds an agent's
  first request (Codex ~8.7k tokens, Claude Code ~12-20k): ``AGENT_CONTEXT`` tokens, as
  make run serves it, while the rest of the suite keeps a shorter one (tests/conftest.py).
  The repository's model allows that much (make setup builds it so); a model that does
  not is rebuilt with the builder's ``--max-model-len`` into the test folder. The vLLM server ends every answer after a few tokens (tests/end_turn_logits.py),
  as a real model ends its turn; everything else is devstack's flags.
- ``recording_proxy``: a ``RecordingProxy`` in front of that edge (what each client sent).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokengate import config as tg_config
from tokengate_dev import devstack
from tokenstorm.process import free_port

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR
from tests.fixtures_edge import EDGE_DIR, VARIANT_PORTS, Edge, _edge_yaml, _start_edge
from tests.fixtures_vllm import VllmFactory, VllmServer
from tests.recording_proxy import RecordingProxy

ROOT = Path(__file__).resolve().parents[1]
# tokens of context the agents need: Claude Code's first request is ~20k tokens with its
# 26 tools (~12k in -p mode with 12), and it asks for max_tokens 32,000 (the demo
# context, and what the repository's model is being given)
AGENT_CONTEXT = 65536
END_TURN_AFTER = 8  # tokens of each answer before the end of the turn
# what tests/end_turn_logits.py reads (not imported: that module imports vLLM)
END_TURN_ENV = "TOKENGATE_TEST_END_TURN_AFTER"


@dataclass(frozen=True)
class AgentTools:
    """The installed clients: the two CLIs and the Python of the frameworks' venv."""

    codex: Path
    claude: Path
    python: Path


@pytest.fixture(scope="session")
def agent_tools() -> AgentTools:
    pointer = ROOT / ".venv" / ".agents"
    assert pointer.exists(), "the agent clients are not installed: run make setup"
    folder = Path(pointer.read_text().strip())
    assert (folder / ".complete").exists(), f"{folder}: incomplete install, run make setup"
    return AgentTools(folder / "node_modules" / ".bin" / "codex",
                      folder / "node_modules" / ".bin" / "claude",
                      folder / "venv" / "bin" / "python")


@dataclass
class AgentsStack:
    """The agents' edge and the vLLM server behind it."""

    edge: Edge
    vllm: VllmServer
    key: str


def _long_model(cfg: tg_config.Config) -> Path:
    """The directory of a model that allows ``AGENT_CONTEXT`` tokens: the repository's
    own (built with 65,536 by make setup), else one built into the test folder."""
    from tokengate.config import loading

    model = cfg.models[MODEL]
    allowed = loading.derived_max_model_len(Path(model.dir))
    if allowed is not None and allowed[0] >= AGENT_CONTEXT:
        return Path(model.dir)
    out = TEST_DIR / "models" / f"{MODEL}-{AGENT_CONTEXT}"
    if not (out / ".complete").exists():
        subprocess.run([sys.executable, "-m", "tokengate_dev.build_tiny_model", "--out",
                        str(out), "--max-model-len", str(AGENT_CONTEXT)], check=True,
                       capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def agents_stack(cfg: tg_config.Config, config_path: Path, vllm_server: VllmFactory,
                 agent_tools: AgentTools) -> Iterator[AgentsStack]:
    from tests.fixtures_edge import MAIN_KEY

    # the suite's server keeps the suite's shorter context; this one serves the agents'
    model_dir = _long_model(cfg)
    extra = ["--model", str(model_dir), "--max-model-len", str(AGENT_CONTEXT)]
    vllm = vllm_server(
        extra_args=(*extra, "--logits-processors", "tests.end_turn_logits:EndTurnAfter"),
        env={"PYTHONPATH": str(ROOT), END_TURN_ENV: str(END_TURN_AFTER)}, label="agents")

    def edit(raw: dict[str, Any]) -> None:
        m = raw["models"][MODEL]
        m["dir"] = str(model_dir)
        m["max_model_len"] = max(m["max_model_len"], AGENT_CONTEXT)
        m["upstreams"] = [vllm.address]
        m.get("routing", {}).pop("kv_events", None)  # this server publishes none
        # edge.special_tokens as configured: escape, the default (the agents' folders
        # hold chat-format text)

    name = "agents"
    usage = EDGE_DIR / name / "usage.jsonl"
    usage.unlink(missing_ok=True)
    path = _edge_yaml(config_path, EDGE_DIR / name / "tokengate.yaml", edit, usage)
    sock = TEST_DIR / "counter-agents.sock"
    counter = devstack.counter_service(path, port=free_port(), unix_socket=sock, workers=2,
                                       name=f"test-counter-agents{PORT_OFFSET or ''}").start()
    try:
        edge = _start_edge(path, next(VARIANT_PORTS),
                           f"test-nginx-{name}{PORT_OFFSET or ''}", sock, usage)
        try:
            yield AgentsStack(edge, vllm, MAIN_KEY)
        finally:
            edge.service.stop()
    finally:
        counter.stop()


@pytest.fixture
def recording_proxy(agents_stack: AgentsStack) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(f"127.0.0.1:{agents_stack.edge.port}").start()
    try:
        yield proxy
    finally:
        proxy.stop()
