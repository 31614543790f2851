"""TokenStorm prompts that share prefixes (``prompts.Sharing``): exact token counts with
the model's tokenizer and chat template, which requests share which tokens, the
cached-token ratio of a run's report; and ``make bench-routing``'s harness end to end on
tiny settings (simulated replicas, the counter, the nginx edge)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokengate import config as tg_config
from tokengate_dev.bench import routing
from tokenstorm.prompts import PromptBuilder, PromptError, Sharing, StreamOptions
from tokenstorm.report import SLO, Records, summarize

PREFIX = 300            # tokens of each tenant's system prompt
SHARING = Sharing(tenants=4, prefix_tokens=PREFIX, conversations=2)


def pair(same_tenant: bool, same_conversation: bool, sharing: Sharing = SHARING,
         ) -> tuple[int, int]:
    """Request 0 and the first later request placed as asked relative to it (seed 0)."""
    t0, c0 = sharing.place(0)
    for j in range(1, 1000):
        t, c = sharing.place(j)
        if (t == t0) == same_tenant and (c == c0) == same_conversation:
            return 0, j
    raise AssertionError("no such request among the first 1000")


SAME_CONVERSATION = pair(True, True)
SAME_TENANT = pair(True, False)
OTHER_TENANT = pair(False, False)


@pytest.fixture(scope="module", params=["chat", "completions"])
def builder(request: pytest.FixtureRequest, cfg: tg_config.Config) -> PromptBuilder:
    m = cfg.models["tiny-qwen3"]
    return PromptBuilder(m.dir, m.name, request.param, sharing=SHARING)


def ids(b: PromptBuilder, index: int, n: int) -> list[int]:
    """The prompt's token ids as vLLM computes them for request ``index`` of ``n``
    tokens (the body's own text, parsed back from the JSON)."""
    body = json.loads(b.body(index, n, 4, StreamOptions()))
    if b.endpoint == "chat":
        msgs = body["messages"]
        assert [m["role"] for m in msgs] == ["system", "user"]
        text = b.render_chat(msgs[1]["content"], msgs[0]["content"])
        return list(b.tokenizer.encode(text, add_special_tokens=False).ids)
    return list(b.tokenizer.encode(body["prompt"], add_special_tokens=True).ids)


def common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def head_tokens(b: PromptBuilder) -> int:
    """Tokens before the system prompt's words: ``<|im_start|>system\\n`` for Qwen3's
    ChatML, none for a completions prompt."""
    return 3 if b.endpoint == "chat" else 0


def user_start(b: PromptBuilder) -> int:
    """Tokens before a request's own words: the template's head, the system prompt,
    then (chat) ``<|im_end|>\\n<|im_start|>user\\n``."""
    return head_tokens(b) + PREFIX + (5 if b.endpoint == "chat" else 0)


@pytest.mark.unit
@pytest.mark.parametrize("n", [314, 315, 400, 1000, 2047, 4096, 8000])
def test_shared_prompts_tokenize_to_exactly_n(builder: PromptBuilder, n: int) -> None:
    n = max(n, builder.min_prompt_tokens)
    for index in (0, 1, 6, 13, 1001):
        assert len(ids(builder, index, n)) == n


@pytest.mark.unit
def test_the_template_overhead_includes_the_system_message(builder: PromptBuilder) -> None:
    # chat: ChatML's 8 tokens plus <|im_start|>system\n ... <|im_end|>\n (5); completions
    # prompts add nothing (Qwen has no BOS)
    assert builder.overhead == (13 if builder.endpoint == "chat" else 0)
    assert builder.min_prompt_tokens == builder.overhead + PREFIX + 1


@pytest.mark.unit
def test_two_conversations_of_a_tenant_share_exactly_its_system_prompt(
        builder: PromptBuilder) -> None:
    a, b = (ids(builder, i, 900) for i in SAME_TENANT)
    assert common(a, b) == user_start(builder)


@pytest.mark.unit
def test_a_conversation_s_later_turn_extends_the_earlier_one(builder: PromptBuilder) -> None:
    first, later = SAME_CONVERSATION
    short, long = ids(builder, first, 700), ids(builder, later, 1200)
    # every token of the shorter prompt but the template's closing ones
    tail = builder.overhead - (head_tokens(builder) + 5 if builder.endpoint == "chat" else 0)
    assert common(short, long) == 700 - tail
    # a later turn shorter than the earlier one is the start of it
    assert common(ids(builder, later, 500), long) == 500 - tail


@pytest.mark.unit
def test_tenants_differ_from_their_first_word(builder: PromptBuilder) -> None:
    a, b = (ids(builder, i, 900) for i in OTHER_TENANT)
    assert common(a, b) == head_tokens(builder)
    prompts = {builder.tenant_prompt(t) for t in range(1000)}
    assert len({p.split(" ", 2)[0] + " " + p.split(" ", 2)[1] for p in prompts}) == 1000


@pytest.mark.unit
def test_no_tenants_no_shared_prefix(cfg: tg_config.Config) -> None:
    m = cfg.models["tiny-qwen3"]
    plain = PromptBuilder(m.dir, m.name, "chat")
    body = json.loads(plain.body(5, 900, 4, StreamOptions()))
    assert [msg["role"] for msg in body["messages"]] == ["user"]
    assert body["messages"][0]["content"] == plain.content(5, 900 - 8)


@pytest.mark.unit
def test_sharing_without_a_system_prompt_shares_histories(cfg: tg_config.Config) -> None:
    m = cfg.models["tiny-qwen3"]
    b = PromptBuilder(m.dir, m.name, "chat", sharing=Sharing(tenants=3))
    first, later = pair(True, True, b.sharing)
    body = json.loads(b.body(later, 200, 4, StreamOptions()))
    assert [msg["role"] for msg in body["messages"]] == ["user"]
    assert b.count(body["messages"][0]["content"]) == 200
    assert body["messages"][0]["content"].startswith(b.parts(first, 100)[1])


@pytest.mark.unit
def test_too_short_for_the_shared_prefix_is_refused(builder: PromptBuilder) -> None:
    with pytest.raises(PromptError, match=f"with a {PREFIX}-token shared prefix"):
        builder.body(0, builder.min_prompt_tokens - 1, 1, StreamOptions())


@pytest.mark.unit
@pytest.mark.parametrize("kw, message", [
    ({"tenants": -1}, "must be >= 0"),
    ({"tenants": 2, "conversations": 0}, "conversations >= 1"),
    ({"prefix_tokens": 100}, "needs tenants"),
])
def test_bad_sharing_is_refused(kw: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sharing(**kw)


@pytest.mark.unit
def test_tenants_and_conversations_are_drawn_uniformly_by_seed() -> None:
    sharing = Sharing(tenants=16, conversations=3)
    places = [sharing.place(j) for j in range(16000)]
    tenants = np.bincount([t for t, _ in places], minlength=16)
    conversations = np.bincount([c for _, c in places], minlength=48)
    assert tenants.min() > 900 and tenants.max() < 1100
    assert conversations.min() > 250 and conversations.max() < 420
    assert all(c // 3 == t for t, c in places)
    assert places[:50] == [sharing.place(j) for j in range(50)]
    assert places[:50] != [sharing.place(j, seed=1) for j in range(50)]
    # request j's tenant is no function of j modulo a replica count: round robin over
    # 4 replicas gives each tenant every replica
    for t in range(16):
        assert {j % 4 for j, (tt, _) in enumerate(places[:400]) if tt == t} == {0, 1, 2, 3}


@pytest.mark.unit
def test_the_report_gives_the_cached_token_ratio() -> None:
    n = 4
    sched = np.arange(n, dtype=np.float64)
    recs = Records(
        sched=sched, sent=sched, first=sched + 0.1, end=sched + 0.2,
        status=np.array([200, 200, 200, 429]), prompt=np.array([1000, 1000, 2000, -1]),
        completion=np.full(n, 10), header_count=np.full(n, -1), chunks=np.full(n, 10),
        error=np.zeros(n, dtype=np.int64), limit=np.zeros(n, dtype=np.int64),
        retry_after=np.full(n, np.nan), expected_prompt=np.array([1000, 1000, 2000, 500]),
        planned_output=np.full(n, 10), key=np.zeros(n, dtype=np.int64),
        burst=np.zeros(n, dtype=bool), itl=np.empty(0),
        cached=np.array([0, 992, 1504, -1]))
    s = summarize(recs, name="t", target="x", mode="open loop", offered="-", stream=True,
                  workers=1, duration_s=4, slo=SLO(), max_lag_ms=10, open_loop=True,
                  key_names=[], check_prompt=True)
    assert (s.all.cached_tokens, s.all.cached_token_ratio) == (2496, 2496 / 4000)
    assert s.to_json()["all"]["cached_token_ratio"] == 0.624


@pytest.mark.slow
def test_bench_routing_end_to_end_on_tiny_settings(tmp_path: Path) -> None:
    """``make bench-routing``'s harness, one short workload: two simulated replicas, the
    counter, an edge per policy. One tenant, one conversation, prompts of one length: the
    same prompt every time. Least outstanding spreads them over both replicas; precise
    prefix routing (a load weight that no few requests in flight outweigh) sends every
    one to the replica that got the first, as its KV events said exactly."""
    out = tmp_path / "routing.json"
    routing.main(["--var", str(tmp_path / "var"), "--out", str(out), "--replicas", "2",
                  "--tenants", "1", "--conversations", "1", "--prefix-tokens", "256",
                  "--history-tokens", "64", "--history-sd", "0", "--output-tokens", "2",
                  "--rate", "6", "--load-weight", "0.1",
                  "--duration", "1.5", "--workloads", "shared",
                  "--policies", "least_outstanding,prefix_precise",
                  "--prefill-tokens-per-s", "1000000", "--itl-ms", "1"])
    res = json.loads(out.read_text())
    sim = res["sections"]["sim"]
    runs = sim["workloads"]["shared"]["policies"]
    assert set(runs) == {"least_outstanding", "prefix_precise"}
    n = runs["prefix_precise"]["requests"]
    assert n >= 3
    for f in runs.values():
        # the same seeded plan for both; every request served, every count exact (the
        # run's validity also depends on the send lag a busy machine gives TokenStorm)
        check = f["summary"]["prompt_check"]
        assert (f["requests"], f["ok"], check["checked"], check["mismatches"]) == (n, n, n, 0)
        assert sum(f["spread"]["requests"].values()) == n
    precise, lo = runs["prefix_precise"], runs["least_outstanding"]
    assert precise["spread"]["busiest_share"] == 1.0
    assert lo["spread"]["busiest_share"] < 1.0
    assert precise["spread"]["prediction_hit_rate"] == 1.0
    # every request but the first is served from the cache but for its last block (the
    # last token is always computed): 320 tokens, 20 blocks of 16, 19 of them cached
    assert precise["cached_tokens"] == (n - 1) * 19 * 16
    assert [(a["workload"], a["figure"]) for a in sim["aims"]] == [
        ("shared", "cached_ratio_x"), ("shared", "ttft_p90_x")]
