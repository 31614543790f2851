"""The prompt of a request to a simulated vLLM replica, in token ids as vLLM computes them
(the rules: ``tokenstorm.upstream.sim``), and the refusals vLLM would answer."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUTPUT_PIECE = " tok"   # the text of every generated token (one token in Qwen's vocabulary)


class BadRequest(ValueError):
    """A request vLLM would refuse: ``status``, OpenAI error ``etype`` and ``param``."""

    def __init__(self, message: str, etype: str = "BadRequestError",
                 param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.etype, self.param, self.status = etype, param, status


def hf_tokenizer(model_dir: Path) -> Any:
    """The transformers tokenizer vLLM loads for ``model_dir``: AutoTokenizer's choice,
    the class ``tokenizer_config.json`` names (``tokenizer_class``; a ``...Fast`` name is
    the class without the suffix where transformers 5 has no such name), imported alone:
    importing ``AutoTokenizer`` costs about 5 s of CPU, the class about 1.6 s, on every
    start of a simulated replica. AutoTokenizer itself when the file names no class that
    transformers has."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    path = model_dir / "tokenizer_config.json"
    name = json.loads(path.read_text()).get("tokenizer_class") if path.exists() else None
    for candidate in ([name, name.removesuffix("Fast")] if isinstance(name, str) else []):
        cls = getattr(transformers, candidate, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls.from_pretrained(str(model_dir))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


class PromptRenderer:
    """Token ids of a request's prompt, as vLLM computes them for the model directory.

    ``backend`` ``hf`` encodes with transformers (vLLM's own path); ``counter`` with
    ``tokengate.counter.tokenizer.PromptTokenizer`` (same ids, faster).
    """

    def __init__(self, model_dir: Path, backend: str = "hf") -> None:
        self.tokenizer: Any = hf_tokenizer(model_dir)
        hf_encode: Callable[[str], list[int]] = \
            lambda text: list(self.tokenizer.encode(text, add_special_tokens=False))
        self._encode = hf_encode
        self._encode_special: Callable[[str], list[int]] = \
            lambda text: list(self.tokenizer.encode(text))
        if backend == "counter":
            from tokengate.counter.tokenizer import PromptTokenizer

            fast = PromptTokenizer.from_model_dir(Path(model_dir))
            self._encode = fast.encode
            if fast.added_by_post_processor == 0:
                self._encode_special = fast.encode
        ids = self._encode(OUTPUT_PIECE)
        # the id every generated token has, and its text
        self.output_token_id = ids[0]
        self.output_text = str(self.tokenizer.decode([self.output_token_id]))

    def chat(self, body: dict[str, Any]) -> list[int]:
        """The prompt of a chat request (``messages``, ``tools``,
        ``chat_template_kwargs``); BadRequest for what the template cannot take."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list", "Bad Request", "body.messages")
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role",
                                 "Bad Request", "body.messages")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"
                            and isinstance(part.get("text"), str)):
                        raise BadRequest(f"messages[{i}].content: only text parts are "
                                         "served here", "Bad Request", "body.messages")
                    texts.append(part["text"])
                m = {**m, "content": "\n".join(texts)}
            conv.append(m)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object", "Bad Request",
                             "body.chat_template_kwargs")
        tools = body.get("tools")
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # the template's raise_exception and jinja errors
            raise BadRequest(f"chat template: {e}") from e
        return self._encode(str(text))

    def completion(self, body: dict[str, Any]) -> list[int]:
        """The prompt of a completions request: a string (tokenized with the
        tokenizer's special tokens) or a list of token ids."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self._encode_special(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.completion({"prompt": prompt[0]})
        raise BadRequest("prompt: a string or a list of token ids (one prompt per request "
                         "here)", "Bad Request", "body.prompt")
