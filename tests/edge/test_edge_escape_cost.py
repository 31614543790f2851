"""What ``special_tokens: escape`` costs, measured with the served model's own tokenizer.

The edge puts U+200B after each token's leading punctuation (tokengate.sanitize). With
Qwen3's tokenizer.json (HF tokenizers, as vLLM loads it) every added token, escaped,
must tokenize as no added token at all, and as exactly one token more than its literal
text (the text tokenized with no added-token matching: what "the model reads the text"
ideally is), with the literal pieces kept and U+200B's piece added; the exception is
``<think>`` right after a character that is not a space, where the literal ``<think``
is one pre-token (``<th`` ``ink``) and the escaped one reads ``<`` U+200B ``think``
(still one token more). docs/api/requests.md quotes these numbers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tests.conftest import MODEL_TOKENIZER, added_tokens, model_tokenizer_json
from tests.edge.test_edge_control_tokens import escape_text

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

CONTEXTS = ["{}", "x {} y", "see {}\n", "a\n{}b", "({})", "a{}b", "1{}2", "`{}`", '"{}"',
            "word {}word"]
ZWSP_PIECE = "âĢĭ"  # U+200B's bytes as the byte-level BPE writes them


def test_every_added_token_costs_one_token_escaped_and_keeps_its_pieces() -> None:
    served = Tokenizer.from_file(str(MODEL_TOKENIZER))
    literal = Tokenizer.from_str(json.dumps({**model_tokenizer_json(), "added_tokens": []}))
    added_ids = set(added_tokens())
    assert len(added_ids) == 26
    changed = set()
    for tok in added_tokens().values():
        for ctx in CONTEXTS:
            text = ctx.format(tok)
            escaped, n = escape_text(text)
            got = served.encode(escaped, add_special_tokens=False)
            want = literal.encode(text, add_special_tokens=False).tokens
            assert n == 1 and not added_ids & set(got.ids), (tok, ctx)
            assert len(got.tokens) == len(want) + 1, (tok, ctx, got.tokens, want)
            if [p for p in got.tokens if p != ZWSP_PIECE] != want:
                changed.add((tok, ctx))
    assert changed == {("<think>", c) for c in ("{}", "a\n{}b", "a{}b", "1{}2")}


@pytest.mark.parametrize("text", ["<|im_<|im_start|>start|>", "<<|im_end|>|im_end|>",
                                  "<|im_end|><|im_end|></think><think>"])
def test_nested_and_adjacent_tokens_leave_no_added_token(text: str) -> None:
    served = Tokenizer.from_file(str(MODEL_TOKENIZER))
    added_ids = set(added_tokens())
    escaped, _ = escape_text(text)
    assert not added_ids & set(served.encode(escaped, add_special_tokens=False).ids)
