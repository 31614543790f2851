"""Prompts of an exact token count: checked with HF tokenizers + the chat template, and
against the prompt_tokens the real vLLM server reports."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tokengate import config as tg_config
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import PromptBuilder, PromptError, StreamOptions
from tokenstorm.runner import RunSpec, execute

from tests.conftest import suite_model

SIZES = [9, 10, 11, 17, 128, 129, 1000, 2047, 4096, 8000]


@pytest.mark.unit
def test_chat_template_overhead_is_measured(prompt_builder: PromptBuilder) -> None:
    # Qwen3 ChatML: <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
    assert prompt_builder.overhead == 8
    assert prompt_builder.min_prompt_tokens == 9
    assert len(prompt_builder.words) > 5000


@pytest.mark.unit
@pytest.mark.parametrize("n", SIZES)
def test_chat_prompts_tokenize_to_exactly_n(prompt_builder: PromptBuilder, n: int) -> None:
    body = json.loads(prompt_builder.body(n * 31 + 5, n, 16, StreamOptions()))
    content = body["messages"][0]["content"]
    assert prompt_builder.count(content) == n


def test_completions_prompts_tokenize_to_exactly_n(cfg: tg_config.Config) -> None:
    m = cfg.models["tiny-qwen3"]
    b = PromptBuilder(m.dir, m.name, "completions")
    assert b.overhead == 0  # Qwen adds no BOS
    for n in (1, 2, 3, 500, 7777):
        body = json.loads(b.body(n, n, 16, StreamOptions()))
        assert b.count(body["prompt"]) == n


def test_prompts_have_unique_prefixes(prompt_builder: PromptBuilder) -> None:
    heads = {prompt_builder.content(i, 50)[:40] for i in range(20000)}
    assert len(heads) == 20000


def test_body_is_the_openai_request(prompt_builder: PromptBuilder) -> None:
    body = json.loads(prompt_builder.body(3, 12, 7, StreamOptions(stream=True)))
    assert set(body) == {"model", "messages", "max_tokens", "ignore_eos", "stream",
                         "stream_options"}
    assert body["model"] == "tiny-qwen3" and body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert len(body["messages"][0]["content"].split(" ")) == 12 - 8


def test_too_short_prompt_is_refused(prompt_builder: PromptBuilder) -> None:
    with pytest.raises(PromptError, match="below the minimum 9"):
        prompt_builder.body(0, 8, 1, StreamOptions())


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_vllm_reports_exactly_the_planned_prompt_tokens(vllm_url: str, cfg: tg_config.Config,
                                                        endpoint: str) -> None:
    m = cfg.models["tiny-qwen3"]
    b = PromptBuilder(m.dir, m.name, endpoint)  # type: ignore[arg-type]
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    for n in (9, 130, 1500, 8000):
        r = httpx.post(vllm_url + path, content=b.body(n, n, 2, StreamOptions()),
                       headers={"content-type": "application/json"}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == n
        assert r.json()["usage"]["completion_tokens"] == 2


def test_tokenstorm_run_against_vllm_checks_every_count(vllm_url: str,
                                                        cfg: tg_config.Config) -> None:
    """A short streamed run against the real server: every response's usage matches
    the plan (prompt and completion tokens). vLLM holds back a token whose bytes are an
    incomplete UTF-8 character and sends it with the next one, so a stream has at most
    one event per token; ITL samples are the gaps between those events."""
    m = cfg.models["tiny-qwen3"]
    spec = RunSpec(url=vllm_url, model=m.name, model_dir=Path(m.dir),
                   max_model_len=m.max_model_len, arrival=ArrivalSpec("constant", rate=8.0),
                   duration_s=2.0, profile="normal:mean=400,sd=300",
                   output=OutputPolicy(fixed=6), stream=StreamOptions(stream=True),
                   max_lag_ms=1000.0, name="vllm-exactness")
    result = execute(spec, progress=False)
    s, r = result.summary, result.records
    assert s.requests == 16 and s.all.ok == 16
    assert s.prompt_check["checked"] == 16 and s.prompt_check["mismatches"] == 0
    assert (r.prompt == r.expected_prompt).all()
    assert (r.completion == 6).all()
    assert ((r.chunks >= 1) & (r.chunks <= 6)).all()
    assert r.itl.size == int((r.chunks - 1).sum())
    assert s.valid, s.invalid_reasons


@pytest.mark.unit
def test_the_simulated_replica_loads_the_tokenizer_vllm_loads() -> None:
    # the class tokenizer_config.json names, imported alone, is AutoTokenizer's choice
    from tokenstorm.upstream.sim_prompts import hf_tokenizer
    from transformers import AutoTokenizer

    model_dir = suite_model().dir
    ours, auto = hf_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(auto)
    text = "<|im_start|>user\nnaïve 東京 tokens<|im_end|>\n"
    assert ours.encode(text, add_special_tokens=False) == \
        auto.encode(text, add_special_tokens=False)
    assert ours.chat_template == auto.chat_template
