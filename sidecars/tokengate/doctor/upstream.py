"""The upstream checks: is every upstream the vLLM that the counter mirrors? Run by
``tokengate doctor`` and, through ``tokengate.doctor.preflight``, by
``tokengate-counter --check-upstreams`` before it serves.

The edge admits, limits and bills on the counter's prompt tokens
(``tokengate.counter.counting``, which mirrors vLLM 0.32's preprocessing) and on the
usage vLLM reports. Both go wrong silently when an upstream is another model, another
vLLM release, or was started without the flags billing reads. For every upstream of
every model, in order:

    health                 GET /health answers 200 (else the rest is skipped)
    model                  GET /v1/models lists the configured name, with the configured
                           max_model_len (vLLM's --served-model-name, --max-model-len)
    version                GET /version is a release in ``VERIFIED_VLLM`` (0.32.x); any
                           other fails, or only warns with ``allow_unverified``
    prompt_tokens_details  a chat answer's usage has prompt_tokens_details (vLLM's
                           --enable-prompt-tokens-details: without it cached tokens are
                           billed as uncached input)
    usage                  that answer's usage.prompt_tokens equals the counter's count
    tool_parser            a chat request with ``tools`` gets 200, not 400 (vLLM's
                           --enable-auto-tool-choice --tool-call-parser)
    engine_records         (``tokengate doctor``) the tokengate vLLM plugin is loaded in
                           this vLLM and writes where the ledger reads: the chat request
                           above has its engine record in one of
                           ``ledger.engine_usage_files``
                           (``tokengate.doctor.engine_records``)
    count <body>           for each of ``PROBES`` (system prompt, tools, multi-turn with a
                           tool call, CJK and emoji, a completions prompt), the counter's
                           prompt tokens equal vLLM's own ``POST /tokenize`` count
    prefix_cache           (``routing.policy: prefix``) vLLM's cache settings are
                           ``routing``'s (``tokengate.doctor.prefix``)
    kv_events              (``routing.policy: prefix``, a replica of ``routing.kv_events``)
                           its KV events carry the counter's block hashes
                           (``tokengate.doctor.prefix``). An entry of
                           ``routing.kv_events`` that is not one of ``upstreams`` is a
                           warning (it is not followed)

The counter runs in this process, from the configuration's model directories (the files
a ``tokengate-counter`` started on the same file loads). ``/tokenize`` request shapes are
vLLM 0.32's ``vllm/entrypoints/serve/tokenize/protocol.py``: ``TokenizeChatRequest``
(``messages``, ``tools``, ``add_generation_prompt`` default true, ``add_special_tokens``
default false: what chat completions do) and ``TokenizeCompletionRequest`` (``prompt``,
a string, ``add_special_tokens`` default true: what completions do); the route is served
at the server's root, not under ``/v1``. Every request goes straight to the upstream,
never through the edge, so nothing here is billed.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokengate import config as tg_config
from tokengate.doctor import fetch
from tokengate.doctor.check import Check, Status
from tokengate.doctor.engine_records import (
    ENGINE_WAIT_S,
    EngineMarks,
    check_records,
    followed_by_ledger,
)
from tokengate.doctor.prefix import kv_events, prefix_cache
from tokengate.ledger.engine_record import DOCTOR_PROBE_PREFIX

if TYPE_CHECKING:  # imported where used: it loads transformers, slow for other commands
    from tokengate.counter.counting import ModelCounter


_VERSION = re.compile(r"(\d+)\.(\d+)")
_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
_CALL = {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# (name, endpoint, body without "model"): what vLLM's /tokenize and the counter both count.
PROBES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("chat_system", "chat", {"messages": [
        {"role": "system", "content": "You are a careful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}]}),
    ("chat_tools", "chat", {"messages": [
        {"role": "system", "content": "Use the tools when they help."},
        {"role": "user", "content": "Is it raining in Paris?"}], "tools": [_WEATHER_TOOL]}),
    ("chat_multi_turn", "chat", {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21.5, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 21.5 °C and clear."},
        {"role": "user", "content": "And tomorrow?"}], "tools": [_WEATHER_TOOL]}),
    ("chat_cjk", "chat", {"messages": [
        {"role": "user", "content": "人工智能正在改变世界。大規模言語モデル。한국어 문장 😀👍🏽"}]}),
    ("completions_prompt", "completions", {
        "prompt": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"}),
)
_PLAIN = [{"role": "user", "content": "Hello!"}]



def version_verified(version: str, verified: tuple[tuple[int, int], ...]) -> bool:
    """Whether a vLLM version string (``0.32.0``, ``0.32.1+cpu``) is of a verified
    (major, minor) release."""
    m = _VERSION.match(version)
    return m is not None and (int(m.group(1)), int(m.group(2))) in verified


def check_upstream(model: tg_config.ModelConfig, upstream: str, counter: ModelCounter | str,
                   *, allow_unverified: bool = False,
                   verified: tuple[tuple[int, int], ...] | None = None,
                   timeout_s: float = 60.0, engine_files: list[Path] | None = None,
                   engine_wait_s: float = ENGINE_WAIT_S) -> Iterator[Check]:
    """The checks of one upstream (``host:port``) of ``model``, in the module's order,
    each yielded as soon as it is known. ``counter``: the model's
    ``tokengate.counter.counting.ModelCounter``, or the ``str`` of why it could not be
    loaded (the count checks then fail with it). ``verified``: (major, minor) releases
    accepted (default ``VERIFIED_VLLM``). ``engine_files``: ``ledger.engine_usage_files``,
    for the ``engine_records`` check (None: not run); ``engine_wait_s``: how long its
    probe's record may take, s."""
    from tokengate.counter.counting import VERIFIED_VLLM, BadRequest

    if verified is None:
        verified = VERIFIED_VLLM
    name, base = model.name, f"http://{upstream}"

    def check(what: str, status: Status, detail: str) -> Check:
        return Check(name, upstream, what, status, detail)

    def counted(endpoint: str, body: dict[str, Any]) -> tuple[int | None, str]:
        if isinstance(counter, str):
            return None, f"the counter cannot load models.{name}.dir: {counter}"
        try:
            return counter.count(endpoint, {"model": name, **body}).prompt_tokens, ""
        except BadRequest as e:
            return None, f"the counter refused the body: {e}"

    prefix = model.routing.policy == "prefix"
    names = ["model", "version", "prompt_tokens_details", "usage", "tool_parser",
             *(["engine_records"] if engine_files is not None else []),
             *(f"count {p[0]}" for p in PROBES),
             *(["prefix_cache"] if prefix else []),
             *(["kv_events"] if upstream in model.kv_events else [])]
    try:
        status = fetch.request("GET", base + "/health", None, timeout_s).status
        why = "" if status == 200 else f"/health answered {status}"
    except fetch.Unreachable as e:
        why = f"unreachable ({e})"
    if why:
        yield check("health", "FAIL", why)
        for rest in names:
            yield check(rest, "SKIP", "not checked: the upstream is not healthy")
        return
    yield check("health", "OK", "/health answered 200")

    try:
        yield from _model(check, model, base, timeout_s)
        yield _version(check, base, allow_unverified, verified, timeout_s)
        probe_id = f"{DOCTOR_PROBE_PREFIX}{uuid.uuid4().hex}"
        marks = EngineMarks.take(engine_files or [])
        answered: list[bool] = []
        yield from _chat_flags(check, model, base, counted, timeout_s, probe_id, answered)
        if engine_files is not None:
            yield check_records(check, upstream, engine_files, marks, f"chatcmpl-{probe_id}",
                                answered == [True], engine_wait_s)
        for probe, endpoint, body in PROBES:
            yield _count(check, model, base, counted, probe, endpoint, body, timeout_s)
        if prefix:
            yield prefix_cache(check, model, base, timeout_s)
        if upstream in model.kv_events:
            yield kv_events(check, model, base, model.kv_events[upstream], counter, timeout_s)
    except fetch.Unreachable as e:
        # it answered /health a moment ago: went away, or too slow for timeout_s
        yield check("connection", "FAIL", f"lost the upstream ({e}); rerun when it is up")


def _model(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
           base: str, timeout_s: float) -> Iterator[Check]:
    a = fetch.request("GET", base + "/v1/models", None, timeout_s)
    data = a.body.get("data") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(data, list):
        yield check("model", "FAIL", f"GET /v1/models: {fetch.why(a)}")
        return
    served = {m.get("id"): m for m in data if isinstance(m, dict)}
    entry = served.get(model.name)
    if entry is None:
        listed = ", ".join(str(s) for s in served) or "nothing"
        yield check("model", "FAIL", f"serves {listed}, not {model.name}: the edge's requests "
                                     f"would get 404 (vLLM's --served-model-name)")
        return
    mlen = entry.get("max_model_len")
    if isinstance(mlen, int) and mlen != model.max_model_len:
        yield check("model", "FAIL", f"serves {model.name} with max_model_len {mlen}, but "
                                     f"models.{model.name}.max_model_len is "
                                     f"{model.max_model_len}: budgets and reservations would "
                                     f"be wrong (vLLM's --max-model-len)")
        return
    yield check("model", "OK", f"serves {model.name} (max_model_len {mlen})")


def _version(check: Callable[[str, Status, str], Check], base: str, allow_unverified: bool,
             verified: tuple[tuple[int, int], ...], timeout_s: float) -> Check:
    tested = ", ".join(f"{a}.{b}.x" for a, b in verified)
    a = fetch.request("GET", base + "/version", None, timeout_s)
    version = a.body.get("version") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(version, str):
        seen = f"no vLLM version (GET /version: {fetch.why(a)})"
    elif version_verified(version, verified):
        return check("version", "OK", f"vLLM {version} (the counter mirrors {tested})")
    else:
        seen = f"vLLM {version} is not a release the counter was verified against ({tested})"
    if allow_unverified:
        return check("version", "WARN", f"{seen}; accepted (--allow-unverified-vllm): "
                                        "the count checks below are the evidence")
    return check("version", "FAIL", f"{seen}: its prompt preprocessing may count "
                                    "differently; --allow-unverified-vllm accepts it")


def _chat_flags(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
                base: str, counted: Callable[[str, dict[str, Any]], tuple[int | None, str]],
                timeout_s: float, request_id: str, answered: list[bool]) -> Iterator[Check]:
    """The chat probes; the first goes with ``X-Request-Id: request_id`` (vLLM names it
    ``chatcmpl-<request_id>``), and ``answered`` gets whether it got a 200; the second
    with an id of its own of the same prefix (``DOCTOR_PROBE_PREFIX``)."""
    url = base + "/v1/chat/completions"
    a = fetch.request("POST", url, {"model": model.name, "messages": _PLAIN, "max_tokens": 1},
              timeout_s, {"X-Request-Id": request_id})
    answered.append(a.status == 200)
    usage = a.body.get("usage") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(usage, dict):
        why = f"a chat request got {fetch.why(a)}"
        yield check("prompt_tokens_details", "FAIL", why)
        yield check("usage", "FAIL", why)
    else:
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            yield check("prompt_tokens_details", "OK",
                        f"usage.prompt_tokens_details present (cached_tokens "
                        f"{details.get('cached_tokens')})")
        else:
            yield check("prompt_tokens_details", "FAIL",
                        "usage.prompt_tokens_details is missing: start vLLM with "
                        "--enable-prompt-tokens-details (without it prefix-cache hits are "
                        "billed as uncached input)")
        mine, why = counted("chat", {"messages": _PLAIN})
        theirs = usage.get("prompt_tokens")
        if mine is None:
            yield check("usage", "FAIL", why)
        elif theirs == mine:
            yield check("usage", "OK", f"usage.prompt_tokens {theirs} = counter {mine}")
        else:
            yield check("usage", "FAIL", f"usage.prompt_tokens {theirs}, counter {mine}")
    # a doctor's id too: the ledger counts its engine record as a probe, not as a
    # request that went around the edge
    a = fetch.request("POST", url, {"model": model.name, "messages": _PLAIN, "max_tokens": 1,
                            "tools": [_WEATHER_TOOL]}, timeout_s,
              {"X-Request-Id": f"{DOCTOR_PROBE_PREFIX}{uuid.uuid4().hex}"})
    if a.status == 200:
        yield check("tool_parser", "OK", "a request with tools got 200")
    elif a.status == 400:
        yield check("tool_parser", "FAIL",
                    f"a request with tools got {fetch.why(a)}: start vLLM with "
                    "--enable-auto-tool-choice --tool-call-parser <the model's parser> "
                    "(hermes for Qwen3)")
    else:
        yield check("tool_parser", "FAIL", f"a request with tools got {fetch.why(a)}")




def _count(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
           base: str, counted: Callable[[str, dict[str, Any]], tuple[int | None, str]],
           probe: str, endpoint: str, body: dict[str, Any], timeout_s: float) -> Check:
    what = f"count {probe}"
    a = fetch.request("POST", base + "/tokenize", {"model": model.name, **body}, timeout_s)
    theirs = a.body.get("count") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(theirs, int):
        return check(what, "FAIL", f"POST /tokenize: {fetch.why(a)}")
    mine, why = counted(endpoint, body)
    if mine is None:
        return check(what, "FAIL", why)
    if mine != theirs:
        return check(what, "FAIL", f"vLLM /tokenize {theirs}, counter {mine} "
                                   f"({theirs - mine:+d}): is models.{model.name}.dir the "
                                   "directory this vLLM loads (tokenizer, chat template)?")
    return check(what, "OK", f"{mine} tokens, vLLM /tokenize agrees")


def _load_counter(model: tg_config.ModelConfig, cfg: tg_config.Config) -> ModelCounter | str:
    from tokengate.counter.counting import ModelCounter
    from tokengate.counter.tokenizer import TokenizerLoadError

    try:
        return ModelCounter.load(model, cfg.edge.chat_template_kwargs_allowed)
    except (OSError, ValueError, KeyError, TokenizerLoadError) as e:
        # missing or broken files: every count check of the model says why
        return f"{type(e).__name__}: {e}"


def wait_healthy(cfg: tg_config.Config, wait_s: float,
                 out: Callable[[str], None] = print) -> None:
    """Poll every upstream's ``/health`` until all answer 200 or ``wait_s`` seconds
    passed (then returns anyway: the health check reports who is not up). Prints one
    progress line every 10 s."""
    pending = {u for m in cfg.models.values() for u in m.upstreams}
    start = last = time.monotonic()
    while pending:
        for u in sorted(pending):
            try:
                if fetch.request("GET", f"http://{u}/health", None, 2.0).status == 200:
                    pending.discard(u)
            except fetch.Unreachable:
                pass
        now = time.monotonic()
        if not pending or now - start >= wait_s:
            return
        if now - last >= 10:
            out(f"waiting for {', '.join(sorted(pending))} (/health), "
                f"{now - start:.0f} of {wait_s:.0f} s")
            last = now
        time.sleep(1.0)


def run(cfg: tg_config.Config, *, allow_unverified: bool = False,
        verified: tuple[tuple[int, int], ...] | None = None, timeout_s: float = 60.0,
        out: Callable[[str], None] = print, engine_records: bool = False,
        engine_wait_s: float = ENGINE_WAIT_S) -> list[Check]:
    """Every check of every upstream of every model; ``out`` gets each ``Check.line()``
    as it is known (progress: a CPU vLLM takes seconds per request). ``engine_records``:
    also check that each replica's plugin writes to ``ledger.engine_usage_files`` (what
    ``tokengate doctor`` does; the counter's ``--check-upstreams`` checks counts only)."""
    checks: list[Check] = []
    # the configured engine files, else those the running ledger follows (make run gives
    # its ledger the embedded vLLM's file on the command line)
    engine = (list(cfg.ledger.engine_usage_files) or followed_by_ledger(cfg)) \
        if engine_records else None
    for model in cfg.models.values():
        counter = _load_counter(model, cfg)
        if model.routing.policy == "prefix":
            for stray in model.routing.kv_events.keys() - set(model.upstreams):
                c = Check(model.name, stray, "kv_events", "WARN",
                          f"models.{model.name}.routing.kv_events names {stray}, which is "
                          "not one of its upstreams: not followed")
                out(c.line())
                checks.append(c)
        for upstream in model.upstreams:
            for c in check_upstream(model, upstream, counter, allow_unverified=allow_unverified,
                                    verified=verified, timeout_s=timeout_s,
                                    engine_files=engine, engine_wait_s=engine_wait_s):
                out(c.line())
                checks.append(c)
    return checks
