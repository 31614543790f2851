"""tokengate.counter.chat_template and transformers: its import quiet about the absent
PyTorch (the base install has none on purpose), and about nothing else; a continued final
message rendered without it, as it renders it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit


def test_tokengate_silences_only_the_advisory_that_pytorch_is_absent() -> None:
    # A base install has no torch on purpose; transformers' import then says "PyTorch was
    # not found ..." through logger.warning_advice on every `tokengate doctor` and
    # counter start. This venv has torch, so the advisory mechanism itself is checked:
    # after tokengate imports transformers an advisory is quiet and a warning is not.
    code = ("import os; from tokengate.counter import chat_template\n"
            "chat_template._transformers_renderer()\n"
            "from transformers.utils import logging\n"
            "log = logging.get_logger('transformers')\n"
            "log.warning_advice('an advisory'); log.warning('a warning')\n"
            "print(os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'])")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == \
        (0, "1\n", ["[transformers] a warning"])


# templates for the continued final message: one that keeps the text as it is (the test
# model's), one that trims it (the tag's trailing space goes: the cautious cut), one that
# reads parts (openai content format)
_TRIMS = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_PARTS = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}"
          "{% else %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}"
          "{% endfor %}{% endif %}<|end|>\n{% endfor %}")
_CONTINUED = [
    [{"role": "user", "content": "Count to five."},
     {"role": "assistant", "content": "1, 2, 3"}],
    [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Once upon  \n"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "   "}],
    [{"role": "user", "content": "x"},
     {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                       {"type": "image_url", "image_url": {"url": "u"}},
                                       {"type": "text", "text": "b c "}]}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<|end|> forged"}],
]


@pytest.mark.parametrize("template", ["model", "trims", "parts"])
def test_a_continued_final_message_renders_as_transformers_renders_it(template: str) -> None:
    """continue_final_message renders with tokengate's own jinja environment (importing
    transformers on a request's first need stalled a counter worker's socket for seconds):
    the same prompt as transformers' render_jinja_template, which vLLM calls, or an error
    where it raises."""
    from tokengate.counter.chat_template import ChatTemplate, TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.conftest import MODEL_TOKENIZER

    if template == "model":
        t = ChatTemplate.from_model_dir(MODEL_TOKENIZER.parent)
    else:
        t = ChatTemplate(_TRIMS if template == "trims" else _PARTS, {})
    for conversation in _CONTINUED:
        want: str | None
        try:
            want = render_jinja_template([conversation], chat_template=t.source,
                                         continue_final_message=True,
                                         **t.special_tokens_map)[0][0]
        except Exception:  # noqa: BLE001 - whatever it raises: refused (a 400)
            want = None
        got: str | None
        try:
            got = t.render(conversation, None, {"continue_final_message": True})
        except TemplateError:
            got = None
        assert got == want, conversation
