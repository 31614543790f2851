"""The agent clients people run, as they run, through the real edge (tests/fixtures_agents.py).

Codex CLI (``codex exec``, Responses API) and Claude Code (``claude -p``, Messages API) each
finish a short task in a folder whose AGENTS.md / CLAUDE.md holds chat-format text
(``<|im_start|>user``, which stays in every later turn's history); the OpenAI Agents SDK
(Responses and Chat Completions models) and LangChain (``ChatOpenAI``, ``ChatAnthropic``)
each make one call. For every request a client sent (a recording proxy in front of the
edge sees them all): answered 200, a usage event whose prompt, completion and cached
tokens are vLLM's own (its engine record of that request) and whose ``X-Token-Count`` is
vLLM's prompt count; with the session id the client sent, once usage events carry one.

No client reaches anything but the loopback edge: each runs with its telemetry, update
checks and retries off, in a home folder of its own, within ``CLIENT_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import MODEL
from tests.doc_pages import code_block
from tests.fixtures_agents import AgentsStack, AgentTools
from tests.recording_proxy import Exchange, RecordingProxy

pytestmark = [pytest.mark.agents]

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TIMEOUT_S = 300
TASK = "Read AGENTS.md and say in one sentence what it is about."
# in the workspace's AGENTS.md / CLAUDE.md: text of the chat format's control tokens
NOTES = ("# Notes\n\nQwen's chat format starts a turn with `<|im_start|>user` and ends it "
         "with `<|im_end|>`.\n")

def doc_block(lang: str) -> str:
    """The first ``lang`` code block of docs/api/coding-agents.md: the tests run the
    configuration the page gives, pointed at the test's edge."""
    return code_block("api/coding-agents.md", lang)


DOC_URL = "http://127.0.0.1:8080"


def _workspace(tmp_path: Path, name: str) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / name).write_text(NOTES)
    return work


def _base_env(home: Path) -> dict[str, str]:
    """A bare environment: PATH, a home of the test's own, no proxy or key of the caller."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                          check=False)


def _engine_records(stack: AgentsStack, offset: int, ids: set[str],
                    timeout_s: float = 60.0) -> dict[str, object]:
    """The vLLM engine records of the edge requests ``ids`` (written when each request
    finished; waits until all are there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = {r.edge_request_id: r for r in stack.vllm.records_since(offset)}
        if ids <= records.keys():
            return {i: records[i] for i in ids}
        assert time.monotonic() < deadline, f"no engine record for {ids - records.keys()}"
        time.sleep(0.2)


def assert_metered(stack: AgentsStack, offset: int, posts: list[Exchange],
                   session_id: str | None) -> list[dict[str, object]]:
    """Every request in ``posts`` answered 200 and billed as vLLM counted it; returns
    their usage events, in order."""
    assert posts, "the client sent no request"
    assert [(ex.path, ex.status) for ex in posts] == [(ex.path, 200) for ex in posts]
    ids = [ex.request_id for ex in posts]
    assert all(ids), "an answer without X-Request-Id"
    records = _engine_records(stack, offset, {str(i) for i in ids})
    events = []
    for ex in posts:
        ev = stack.edge.event(str(ex.request_id))
        rec = records[str(ex.request_id)]
        assert (ev["status"], ev["prompt_tokens"], ev["completion_tokens"],
                ev["cached_tokens"]) == (200, rec.num_prompt_tokens,  # type: ignore[attr-defined]
                                         rec.num_generation_tokens,  # type: ignore[attr-defined]
                                         rec.num_cached_tokens)  # type: ignore[attr-defined]
        assert ex.token_count == ev["prompt_tokens"]
        if session_id is not None:
            assert ev["session_id"] == session_id
        events.append(ev)
    return events


def _max_tokens(body: dict[str, object]) -> object:
    """The output limit a body asks for, under whichever name its API uses."""
    for name in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        if name in body:
            return body[name]
    return None


def _report(client: str, posts: list[Exchange], events: list[dict[str, object]]) -> None:
    """One line per client in the test's output (-s, or the report of a failure): what it
    sent and what was billed."""
    sent = [(ex.path.split("?")[0], ex.body_bytes, len((ex.body or {}).get("tools") or []),
             _max_tokens(ex.body or {}))
            for ex in posts]
    billed = [(ev["prompt_tokens"], ev["cached_tokens"], ev["completion_tokens"])
              for ev in events]
    print(f"\n{client}: requests {len(posts)}; sent (path, bytes, tools, max tokens) "
          f"{sent}; billed (prompt, cached, completion) {billed}")


def test_codex_exec_finishes_with_chat_format_text_in_agents_md(
        agents_stack: AgentsStack, agent_tools: AgentTools, recording_proxy: RecordingProxy,
        tmp_path: Path) -> None:
    work = _workspace(tmp_path, "AGENTS.md")
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    # the page's configuration (Responses, the only wire_api Codex 0.171 accepts; no
    # update check, analytics or feedback upload), and for a bounded run: no approvals, a
    # read-only sandbox, no retries (a refusal shows at once); the provider's table is
    # the page's block's last
    provider = doc_block("toml").replace(DOC_URL, recording_proxy.url)
    (codex_home / "config.toml").write_text(f"""\
approval_policy = "never"
sandbox_mode = "read-only"
{provider}request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 120000
""")
    env = _base_env(tmp_path / "home") | {"CODEX_HOME": str(codex_home),
                                          "TOKENGATE_API_KEY": agents_stack.key}
    offset = agents_stack.vllm.size()
    r = _run([str(agent_tools.codex), "exec", "--json", "--strict-config", "--ephemeral",
              "--skip-git-repo-check", "-C", str(work), TASK], env, work)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    thread = next(x["thread_id"] for x in lines if x["type"] == "thread.started")
    assert [x["type"] for x in lines if x["type"].startswith("turn.")] == \
        ["turn.started", "turn.completed"]
    posts = recording_proxy.posts()
    assert "<|im_start|>user" in json.dumps(posts[0].body)  # AGENTS.md went to the model
    assert {ex.headers.get("session-id") for ex in posts} == {thread}
    events = assert_metered(agents_stack, offset, posts, thread)
    # Codex's own tally of the turn is what was billed
    usage = next(x["usage"] for x in lines if x["type"] == "turn.completed")
    assert (usage["input_tokens"], usage["cached_input_tokens"], usage["output_tokens"]) == (
        sum(int(ev["prompt_tokens"]) for ev in events),  # type: ignore[call-overload]
        sum(int(ev["cached_tokens"]) for ev in events),  # type: ignore[call-overload]
        sum(int(ev["completion_tokens"]) for ev in events))  # type: ignore[call-overload]
    _report("codex exec", posts, events)


def test_claude_print_finishes_with_chat_format_text_in_claude_md(
        agents_stack: AgentsStack, agent_tools: AgentTools, recording_proxy: RecordingProxy,
        tmp_path: Path) -> None:
    work = _workspace(tmp_path, "CLAUDE.md")
    home = tmp_path / "home"
    # the page's variables, pointed at the test's edge and key
    readme_env = dict(re.findall(r"(\w+)=(\S+)", doc_block("sh")))
    assert readme_env["ANTHROPIC_MODEL"] == MODEL
    readme_env |= {"ANTHROPIC_BASE_URL": recording_proxy.url,
                   "ANTHROPIC_API_KEY": agents_stack.key}
    env = _base_env(home) | readme_env | {
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        # no telemetry, error reports, update checks or feedback surveys whatever the
        # the page says; no retries (a refusal shows at once), 120 s per call
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "CLAUDE_CODE_MAX_RETRIES": "0",
        "API_TIMEOUT_MS": "120000"}
    offset = agents_stack.vllm.size()
    r = _run([str(agent_tools.claude), "-p", TASK, "--output-format", "json"], env, work)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    result = json.loads(r.stdout)
    assert (result["is_error"], result["subtype"]) == (False, "success")
    posts = recording_proxy.posts()
    assert all(ex.path.startswith("/v1/messages") for ex in posts)
    assert "<|im_start|>user" in json.dumps(posts[0].body)  # CLAUDE.md went to the model
    # Claude Code's default output limit, answered 200 where vLLM answers it (the
    # context holds prompt + 32,000)
    assert posts[0].body is not None and posts[0].body["max_tokens"] == 32000
    session = result["session_id"]
    assert {ex.headers.get("x-claude-code-session-id") for ex in posts} == {session}
    events = assert_metered(agents_stack, offset, posts, session)
    _report("claude -p", posts, events)


@pytest.mark.parametrize("client", ["agents-responses", "agents-chat", "langchain-openai",
                                    "langchain-anthropic"])
def test_framework_call_is_metered(client: str, agents_stack: AgentsStack,
                                   agent_tools: AgentTools, recording_proxy: RecordingProxy,
                                   tmp_path: Path) -> None:
    env = _base_env(tmp_path / "home") | {"OPENAI_AGENTS_DISABLE_TRACING": "1"}
    offset = agents_stack.vllm.size()
    r = _run([str(agent_tools.python), str(ROOT / "tests" / "agent_clients.py"), client,
              "--base-url", f"{recording_proxy.url}/v1", "--key", agents_stack.key,
              "--model", MODEL, "--max-tokens", "16"], env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "text" in json.loads(r.stdout.splitlines()[-1])
    posts = recording_proxy.posts()
    path = {"agents-responses": "/v1/responses", "agents-chat": "/v1/chat/completions",
            "langchain-openai": "/v1/chat/completions",
            "langchain-anthropic": "/v1/messages"}[client]
    assert [ex.path for ex in posts] == [path]
    events = assert_metered(agents_stack, offset, posts, None)
    _report(client, posts, events)


def test_readme_agents_sdk_example_is_metered(agents_stack: AgentsStack,
                                              agent_tools: AgentTools,
                                              recording_proxy: RecordingProxy,
                                              tmp_path: Path) -> None:
    code = doc_block("python").replace(f"{DOC_URL}/v1", f"{recording_proxy.url}/v1")
    code = code.replace('"tg-demo-key"', repr(agents_stack.key))
    offset = agents_stack.vllm.size()
    r = _run([str(agent_tools.python), "-c", code], _base_env(tmp_path / "home"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    posts = recording_proxy.posts()
    assert [ex.path for ex in posts] == ["/v1/responses"]
    events = assert_metered(agents_stack, offset, posts, None)
    _report("docs Agents SDK example", posts, events)
