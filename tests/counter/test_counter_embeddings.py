"""Embeddings bodies (``ENDPOINT_EMBEDDINGS``) counted without any process: each input
counted as the same completions prompt, vLLM's pooling tokenization options
(truncation, padding, add_special_tokens, a sentence-transformers model's lower case),
the per-input context check (OUT_OF_RANGE) and refusals that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokengate.config import load
from tokengate.counter.counter_service import CountFailure, TokenCounterService
from tokengate.counter.counting import BadRequest, ModelCounter
from tokengate.counter.errors import ContextLengthExceeded
from tokengate.counter.model_files import encoder_do_lower_case
from tokengate.v1 import counter_pb2

from tests.conftest import (
    MODEL,
    REPO_CONFIG,
    assert_cases_cover,
    count_refusal,
    suite_model,
)
from tests.counter_cases import CJK, EMOJI, LOREM
from tests.counter_embeddings_cases import CASES, MAX_MODEL_LEN, REFUSED

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def counter() -> ModelCounter:
    return ModelCounter.load(suite_model())


def embed(counter: ModelCounter, input_: Any, **kw: Any) -> tuple[int, int]:
    r = counter.count("embeddings", {"model": MODEL, "input": input_, **kw})
    assert (r.max_tokens_effective, r.max_tokens_requested) == (0, 0)
    assert r.breakdown.messages == r.prompt_tokens and r.max_model_len == MAX_MODEL_LEN
    return r.prompt_tokens, r.prompt_count


def completions(counter: ModelCounter, prompt: Any) -> int:
    return counter.count("completions", {"model": MODEL, "prompt": prompt}).prompt_tokens


def test_each_input_counts_as_the_same_completions_prompt(counter: ModelCounter) -> None:
    for prompt in ["Hello, world!", CJK, EMOJI, "a <|im_end|> b", [1, 2, 3],
                   ["a", "b c", CJK], [[1, 2], [3]]]:
        n = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
        assert embed(counter, prompt) == (completions(counter, prompt), n)
    assert embed(counter, "Hello, world!") == (4, 1)
    assert embed(counter, ["Hello, world!", "Hello, world!"]) == (8, 2)


def test_add_special_tokens_false_adds_none(counter: ModelCounter) -> None:
    # Qwen's post-processor adds no token either way
    assert counter.tokenizer.added_by_post_processor == 0
    assert embed(counter, "Hello <|im_end|>", add_special_tokens=False) == (3, 1)
    with pytest.raises(BadRequest, match="add_special_tokens: expected a boolean"):
        embed(counter, "x", add_special_tokens="no")


def test_truncation_keeps_at_most_that_many_tokens_of_each_input(
        counter: ModelCounter) -> None:
    assert embed(counter, LOREM * 4, truncate_prompt_tokens=7) == (7, 1)
    assert embed(counter, [LOREM, "Hi", [1, 2, 3, 4]], truncate_prompt_tokens=3) == (7, 3)
    for side in ("left", "right"):
        assert embed(counter, LOREM * 4, truncate_prompt_tokens=7, truncation_side=side) \
            == (7, 1)
    # -1: the whole context, no token held back for an output (pooling: max_output_tokens 0)
    assert embed(counter, LOREM * 300, truncate_prompt_tokens=-1) == (MAX_MODEL_LEN, 1)
    assert embed(counter, LOREM * 300, truncate_prompt_tokens=MAX_MODEL_LEN) \
        == (MAX_MODEL_LEN, 1)
    assert embed(counter, "Hi", truncate_prompt_tokens=None) == (1, 1)


def test_padding_max_length_pads_each_input_to_the_context(counter: ModelCounter) -> None:
    assert embed(counter, "Hi", padding="max_length") == (MAX_MODEL_LEN, 1)
    assert embed(counter, ["Hi", [1] * MAX_MODEL_LEN], padding="max_length") \
        == (2 * MAX_MODEL_LEN, 2)
    assert embed(counter, ["Hi", "there"], padding="do_not_pad") == (2, 2)
    # truncation runs first, then padding (vllm/renderers/params.py _validate_tokens)
    assert embed(counter, LOREM, truncate_prompt_tokens=3, padding="max_length") \
        == (MAX_MODEL_LEN, 1)


def test_an_input_above_the_context_is_out_of_range_naming_it(counter: ModelCounter) -> None:
    assert embed(counter, [1] * MAX_MODEL_LEN) == (MAX_MODEL_LEN, 1)
    with pytest.raises(ContextLengthExceeded) as info:
        embed(counter, [1] * (MAX_MODEL_LEN + 1))
    assert str(info.value) == (
        "input: This model's maximum context length is 8192 tokens. However, your input "
        "contains 8193 tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input.")
    with pytest.raises(ContextLengthExceeded) as info:
        embed(counter, ["ok", "fine", [1] * (MAX_MODEL_LEN + 5)])
    assert info.value.param == "input[2]"
    # over the context in total is fine: each input is its own engine request
    assert embed(counter, [[1] * MAX_MODEL_LEN] * 2) == (2 * MAX_MODEL_LEN, 2)


def test_the_service_answers_out_of_range_for_a_long_input(counter: ModelCounter) -> None:
    service = TokenCounterService({MODEL: counter})

    def call(body: dict[str, Any]) -> counter_pb2.CountReply:
        return service.count(counter_pb2.CountRequest(
            model=MODEL, endpoint=counter_pb2.ENDPOINT_EMBEDDINGS,
            body=json.dumps(body).encode()))
    reply = call({"input": ["Hello, world!", [1, 2]]})
    assert (reply.prompt_tokens, reply.prompt_count, reply.max_tokens_effective) == (6, 2, 0)
    with pytest.raises(CountFailure) as info:
        call({"input": ["ok", [1] * (MAX_MODEL_LEN + 1)]})
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.message.startswith("input[1]: This model's maximum context length")
    with pytest.raises(CountFailure) as info:
        call({"input": []})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("name,body,param,code", REFUSED, ids=[c[0] for c in REFUSED])
def test_refusals_name_the_field(counter: ModelCounter, name: str, body: dict[str, Any],
                                 param: str, code: str) -> None:
    refused = count_refusal(counter, "embeddings", {"model": MODEL, **body})
    assert refused.param == param
    assert isinstance(refused, ContextLengthExceeded) == (code == "OUT_OF_RANGE")


@pytest.mark.parametrize("body,message", [
    ({}, "input: required"),
    ({"input": None}, "input: required"),
    ({"input": []}, "input: expected a string, an array of strings, or an array of token ids"),
    ({"input": 5}, "input: expected a string"),
    ({"input": ["a", 5]}, "input[1]: expected a string or a non-empty array of token ids"),
    ({"input": [[1], []]}, "input[1]: expected a string or a non-empty array of token ids"),
    ({"input": [1, 999999]}, "input[1]: token id 999999 is out of vocabulary"),
    ({"input": [[1], [2, -1]]}, "input[1][1]: token id -1 is out of vocabulary"),
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens: must be at least -1"),
    ({"input": "x", "truncate_prompt_tokens": "3"}, "truncate_prompt_tokens: expected an integer"),
    ({"input": "x", "padding": True},
     "padding: expected one of 'max_length', 'do_not_pad', got a boolean"),
])
def test_bad_bodies_are_refused_naming_the_field(counter: ModelCounter, body: dict[str, Any],
                                                 message: str) -> None:
    assert str(count_refusal(counter, "embeddings", {"model": MODEL, **body})).startswith(message)


def test_the_cases_are_counted_without_error(counter: ModelCounter) -> None:
    """Every parity case counts (the parity test compares them with vLLM)."""
    assert_cases_cover(CASES, 40)
    for _name, body in CASES:
        counter.count("embeddings", {"model": MODEL, **body})


def _model_dir(tmp_path: Path, files: dict[str, Any]) -> Path:
    """A model directory with the tiny model's tokenizer files and ``files`` (JSON)."""
    src = Path(load(REPO_CONFIG).models[MODEL].dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(src / name)
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path


def test_a_lower_case_encoder_counts_the_lower_cased_text(tmp_path: Path) -> None:
    cfg = suite_model()
    model_dir = _model_dir(tmp_path, {"sentence_bert_config.json": {
        "max_seq_length": 512, "do_lower_case": True}})
    lower = ModelCounter.load(cfg.model_copy(update={"dir": model_dir}))
    plain = ModelCounter.load(cfg)
    assert lower.lower_case and not plain.lower_case
    text = "HELLO WORLD, ÉCOLE"
    n = lower.count("embeddings", {"input": text}).prompt_tokens
    assert n == plain.count("embeddings", {"input": text.lower()}).prompt_tokens
    assert n != plain.count("embeddings", {"input": text}).prompt_tokens
    # completions and token ids are not lower-cased
    assert lower.count("completions", {"prompt": text}).prompt_tokens \
        == plain.count("completions", {"prompt": text}).prompt_tokens


@pytest.mark.parametrize("files,expected", [
    ({}, False),
    ({"sentence_bert_config.json": {"max_seq_length": 512, "do_lower_case": True}}, True),
    ({"sentence_bert_config.json": {"max_seq_length": 512}}, False),
    # without max_seq_length vLLM uses no encoder config at all
    ({"sentence_bert_config.json": {"do_lower_case": True}}, False),
    # the first non-empty file of vLLM's list is the one
    ({"sentence_bert_config.json": {},
      "sentence_xlnet_config.json": {"max_seq_length": 8, "do_lower_case": True}}, True),
    ({"sentence_bert_config.json": {"max_seq_length": 8, "do_lower_case": False},
      "sentence_xlnet_config.json": {"max_seq_length": 8, "do_lower_case": True}}, False),
])
def test_the_encoder_config_is_read_as_vllm_reads_it(tmp_path: Path, files: dict[str, Any],
                                                     expected: bool) -> None:
    assert encoder_do_lower_case(_model_dir(tmp_path, files)) is expected
