"""A request's prompt tokens and TPM reservation, counted offline with the counter's own
library (``tokengate.counter.counting``: the served model's tokenizer and chat template
from ``models.<name>.dir``), before the request is sent.

That library is the ``tokengate`` package's (``pip install ./sidecars``, or
``tokengate-client[offline]`` beside it): a client given no ``config`` never imports it,
so the SDK alone needs only ``openai``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokengate import config as tg_config
    from tokengate.counter.counting import ModelCounter

OFFLINE_MISSING = ("counting prompts offline (config=...) needs the tokengate package, "
                   "the counter's own library: pip install ./sidecars, or "
                   "'tokengate-client[offline]' beside it; or pass config=None")

# create() keyword arguments that are the openai client's, not the request body's
_TRANSPORT_KWARGS = frozenset({"extra_headers", "extra_query", "extra_body", "timeout"})


@dataclass(frozen=True)
class Estimate:
    """What the edge will count for a request (tokens)."""

    prompt_tokens: int
    completion_budget: int   # max_tokens_effective: what the answer may generate
    reservation: int         # the TPM reservation at admission (DESIGN contract 3)


def request_body(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON body the openai client will send for ``create(**kwargs)``; None when a
    value is not JSON (the counter cannot see it as the edge will)."""
    body = {k: v for k, v in kwargs.items() if k not in _TRANSPORT_KWARGS}
    body.update(kwargs.get("extra_body") or {})

    def plain(v: Any) -> Any:
        dump = getattr(v, "model_dump", None)
        if dump is None:
            raise TypeError(type(v).__name__)
        return dump(exclude_unset=True)
    try:
        parsed: dict[str, Any] = json.loads(json.dumps(body, default=plain))
    except (TypeError, ValueError):
        return None
    return parsed


class PromptCounter:
    """Counts requests for the models of a tokengate configuration (``tokengate.yaml``,
    the file the gateway reads; only ``models`` and ``edge`` are used)."""

    def __init__(self, cfg: tg_config.Config) -> None:
        self._cfg = cfg
        self._models: dict[str, ModelCounter] = {}

    @classmethod
    def of(cls, config: str | Path | tg_config.Config) -> PromptCounter:
        """The counter for a configuration, loaded or a path. Raises
        ``tokengate.config.ConfigError`` for an unreadable or invalid file, ImportError
        (``OFFLINE_MISSING``) without the tokengate package."""
        try:
            from tokengate import config as tg_config
        except ImportError as e:
            raise ImportError(OFFLINE_MISSING) from e
        if isinstance(config, tg_config.Config):
            return cls(config)
        return cls(tg_config.load(Path(config)))

    def _model(self, name: str) -> ModelCounter | None:
        from tokengate.counter.counting import ModelCounter

        counter = self._models.get(name)
        if counter is None and name in self._cfg.models:
            counter = ModelCounter.load(self._cfg.models[name],
                                        self._cfg.edge.chat_template_kwargs_allowed)
            self._models[name] = counter
        return counter

    def estimate(self, endpoint: str, kwargs: dict[str, Any]) -> Estimate | None:
        """The request's count for ``endpoint`` "chat", "completions", "responses" or
        "embeddings" (``create``'s keyword arguments; a Responses body's
        ``max_output_tokens`` is its completion budget, an embeddings body has none);
        None when it cannot be counted here (unknown model, a body
        the edge will refuse anyway: it is then sent unpaced and the edge answers)."""
        body = request_body(kwargs)
        if body is None or not isinstance(body.get("model"), str):
            return None
        counter = self._model(body["model"])
        if counter is None:
            return None
        from tokengate.counter.counting import BadRequest

        try:
            counted = counter.count(endpoint, body)
        except BadRequest:
            return None
        n = body["n"] if isinstance(body.get("n"), int) else 1
        # lua/tokengate/limits.lua reservation(): prompt + n x prompts x min(budget,
        # output_reserve); the edge's cap can only lower the budget, so this is an
        # upper bound of the edge's reservation
        out = min(counted.max_tokens_effective, counter.model.output_reserve)
        reservation = counted.prompt_tokens + n * counted.prompt_count * out
        return Estimate(counted.prompt_tokens, counted.max_tokens_effective, reservation)
