"""The upstream checks: is every upstream the vLLM that the counter mirrors? Run by
``tokengate doctor`` and by ``tokengate-counter --check-upstreams`` before it serves.

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
                           above, sent with ``X-Request-Id: tokengate-doctor-<hex>``, has
                           its engine record (request_id ``chatcmpl-<that id>``) appended
                           to one of ``ledger.engine_usage_files`` within
                           ``engine_wait_s``. vLLM shows no sign of its stat-logger
                           plugins on any route or metric, so the record is the evidence;
                           it also proves the file is one the ledger reads. A replica on
                           another host whose files are not here is a warning (run the
                           doctor there); a loopback one without its record fails
    count <body>           for each of ``PROBES`` (system prompt, tools, multi-turn with a
                           tool call, CJK and emoji, a completions prompt), the counter's
                           prompt tokens equal vLLM's own ``POST /tokenize`` count
    prefix_cache           (``routing.policy: prefix``) the labels of vLLM's
                           ``vllm:cache_config_info`` on ``GET /metrics``: prefix caching
                           on, ``block_size`` and ``prefix_caching_hash_algo`` as
                           ``routing`` says (else the counter's block hashes never match
                           the replica's)
    kv_events              (``routing.policy: prefix``, a replica of ``routing.kv_events``)
                           a ZMQ subscriber connects to its publisher, a completions probe
                           of a fresh random prompt of two blocks and a token (token ids,
                           one generated token) is sent, and a ``BlockStored`` event of it
                           must carry the counter's hashes of those blocks within
                           ``KV_EVENTS_WAIT_S``: the endpoint, the events and the seed
                           (``routing.hash_seed``, which no route shows) are checked at
                           once. An entry of ``routing.kv_events`` that is not one of
                           ``upstreams`` is a warning (it is not followed)

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

import json
import os
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tokengate import config as tg_config
from tokengate.ledger.engine_record import DOCTOR_PROBE_PREFIX

if TYPE_CHECKING:  # imported where used: it loads transformers, slow for other commands
    from tokengate.counter.counting import ModelCounter

Status = Literal["OK", "WARN", "FAIL", "SKIP"]

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
ENGINE_WAIT_S = 5.0  # how long a probe's engine record may take to appear, s
KV_EVENTS_WAIT_S = 10.0  # how long the kv_events probe waits to connect, then for its event
# vllm:cache_config_info's labels (vllm/config/cache.py CacheConfig.metrics_info)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Check:
    """One check of one upstream: ``status`` OK | WARN (passes, with a caveat) | FAIL |
    SKIP (not run: the upstream is unreachable); ``detail``: what was seen, and for a
    failure what to change."""

    model: str
    upstream: str
    name: str
    status: Status
    detail: str

    def line(self) -> str:
        """``<STATUS> <model> <host:port> <check>: <detail>``"""
        return f"{self.status:<4} {self.model} {self.upstream} {self.name}: {self.detail}"


class _Unreachable(Exception):
    """No HTTP answer (connection refused, timeout, reset)."""


@dataclass(frozen=True)
class _Answer:
    status: int
    body: Any  # parsed JSON, or None


def _http(method: str, url: str, body: Any, timeout_s: float,
          headers: dict[str, str] | None = None) -> _Answer:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError) as e:  # URLError, timeouts, a reset; a bad URL
        raise _Unreachable(str(getattr(e, "reason", None) or e)) from None
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    return _Answer(status, parsed)


def _why(a: _Answer) -> str:
    """A refusal as one short phrase: ``HTTP 400: <vLLM's message>``."""
    msg = None
    if isinstance(a.body, dict):
        err = a.body.get("error")
        msg = err.get("message") if isinstance(err, dict) else a.body.get("detail")
    text = f"HTTP {a.status}"
    if isinstance(msg, str) and msg:
        msg = " ".join(msg.split())
        text += ": " + (msg if len(msg) <= 200 else msg[:197] + "...")
    return text


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
        status = _http("GET", base + "/health", None, timeout_s).status
        why = "" if status == 200 else f"/health answered {status}"
    except _Unreachable as e:
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
        marks = _EngineMarks.take(engine_files or [])
        answered: list[bool] = []
        yield from _chat_flags(check, model, base, counted, timeout_s, probe_id, answered)
        if engine_files is not None:
            yield _engine_records(check, upstream, engine_files, marks, f"chatcmpl-{probe_id}",
                                  answered == [True], engine_wait_s)
        for probe, endpoint, body in PROBES:
            yield _count(check, model, base, counted, probe, endpoint, body, timeout_s)
        if prefix:
            yield _prefix_cache(check, model, base, timeout_s)
        if upstream in model.kv_events:
            yield _kv_events(check, model, base, model.kv_events[upstream], counter,
                             timeout_s)
    except _Unreachable as e:
        # it answered /health a moment ago: went away, or too slow for timeout_s
        yield check("connection", "FAIL", f"lost the upstream ({e}); rerun when it is up")


def _model(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
           base: str, timeout_s: float) -> Iterator[Check]:
    a = _http("GET", base + "/v1/models", None, timeout_s)
    data = a.body.get("data") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(data, list):
        yield check("model", "FAIL", f"GET /v1/models: {_why(a)}")
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
    a = _http("GET", base + "/version", None, timeout_s)
    version = a.body.get("version") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(version, str):
        seen = f"no vLLM version (GET /version: {_why(a)})"
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
    a = _http("POST", url, {"model": model.name, "messages": _PLAIN, "max_tokens": 1},
              timeout_s, {"X-Request-Id": request_id})
    answered.append(a.status == 200)
    usage = a.body.get("usage") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(usage, dict):
        why = f"a chat request got {_why(a)}"
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
    a = _http("POST", url, {"model": model.name, "messages": _PLAIN, "max_tokens": 1,
                            "tools": [_WEATHER_TOOL]}, timeout_s,
              {"X-Request-Id": f"{DOCTOR_PROBE_PREFIX}{uuid.uuid4().hex}"})
    if a.status == 200:
        yield check("tool_parser", "OK", "a request with tools got 200")
    elif a.status == 400:
        yield check("tool_parser", "FAIL",
                    f"a request with tools got {_why(a)}: start vLLM with "
                    "--enable-auto-tool-choice --tool-call-parser <the model's parser> "
                    "(hermes for Qwen3)")
    else:
        yield check("tool_parser", "FAIL", f"a request with tools got {_why(a)}")


@dataclass(frozen=True)
class _EngineMarks:
    """Where each engine usage file ended before the probe: (device, inode, size), or
    None for a file that was not there, or the ``str`` of why it could not be read."""

    at: dict[Path, tuple[int, int, int] | None | str]

    @classmethod
    def take(cls, files: list[Path]) -> _EngineMarks:
        at: dict[Path, tuple[int, int, int] | None | str] = {}
        for f in files:
            try:
                st = os.stat(f)
                at[f] = (st.st_dev, st.st_ino, st.st_size)
            except FileNotFoundError:
                at[f] = None
            except OSError as e:
                at[f] = e.strerror or str(e)
        return cls(at)


def _find_record(path: Path, mark: tuple[int, int, int] | None | str,
                 request_id: str) -> bool | str:
    """Whether a complete line written to ``path`` since ``mark`` is the engine record
    of ``request_id`` (a file replaced since, by a rotation, is read from its start), or
    the ``str`` of why it cannot be read."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            start = 0
            if isinstance(mark, tuple) and mark[:2] == (st.st_dev, st.st_ino) \
                    and mark[2] <= st.st_size:
                start = mark[2]
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError as e:
        return e.strerror or str(e)
    for line in data.split(b"\n")[:-1]:  # the last piece is not a whole line yet
        if request_id.encode() not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("request_id") == request_id:
            return True
    return False


def _engine_records(check: Callable[[str, Status, str], Check], upstream: str,
                    files: list[Path], marks: _EngineMarks, request_id: str, answered: bool,
                    wait_s: float) -> Check:
    what = "engine_records"
    if not files:
        return check(what, "FAIL", "ledger.engine_usage_files is empty: the ledger reads no "
                                   "engine records, so client disconnects and n > 1 are "
                                   "billed from the edge's numbers; list each replica's "
                                   "TOKENGATE_ENGINE_USAGE_FILE there (tokengate-vllm@PORT "
                                   "writes /var/lib/tokengate/engine/PORT.jsonl)")
    if not answered:
        return check(what, "SKIP", "not checked: the chat request failed (above)")
    listed = ", ".join(map(str, files))
    deadline = time.monotonic() + wait_s
    while True:
        unreadable: dict[Path, str] = {}
        for f in files:
            mark = marks.at.get(f)
            found = _find_record(f, None if isinstance(mark, str) else mark, request_id)
            if found is True:
                return check(what, "OK", f"the tokengate vLLM plugin recorded the probe "
                                         f"({request_id}) in {f}")
            if isinstance(found, str):
                unreadable[f] = found
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if unreadable:
        why = "; ".join(f"{f}: {e}" for f, e in unreadable.items())
        return check(what, "WARN", f"cannot read {why}: run tokengate doctor as a user that "
                                   "may (root, or the tokengate user)")
    present = [f for f in files if f.exists()]
    if not present and not tg_config._is_loopback(upstream):
        return check(what, "WARN", f"not checked here: none of ledger.engine_usage_files "
                                   f"({listed}) exists on this host; run tokengate doctor on "
                                   "the vLLM host, where its records are written")
    return check(what, "FAIL", f"no engine record of the probe ({request_id}) in {listed} "
                               f"after {wait_s:g} s: is the tokengate vLLM plugin installed in "
                               "this vLLM's environment (pip install --no-deps ./vllm_patches; "
                               "vLLM then logs 'engine usage records: engine 0 writes to "
                               "...') and is its TOKENGATE_ENGINE_USAGE_FILE one of "
                               "ledger.engine_usage_files?")


def _count(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
           base: str, counted: Callable[[str, dict[str, Any]], tuple[int | None, str]],
           probe: str, endpoint: str, body: dict[str, Any], timeout_s: float) -> Check:
    what = f"count {probe}"
    a = _http("POST", base + "/tokenize", {"model": model.name, **body}, timeout_s)
    theirs = a.body.get("count") if isinstance(a.body, dict) else None
    if a.status != 200 or not isinstance(theirs, int):
        return check(what, "FAIL", f"POST /tokenize: {_why(a)}")
    mine, why = counted(endpoint, body)
    if mine is None:
        return check(what, "FAIL", why)
    if mine != theirs:
        return check(what, "FAIL", f"vLLM /tokenize {theirs}, counter {mine} "
                                   f"({theirs - mine:+d}): is models.{model.name}.dir the "
                                   "directory this vLLM loads (tokenizer, chat template)?")
    return check(what, "OK", f"{mine} tokens, vLLM /tokenize agrees")


def _prefix_cache(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
                  base: str, timeout_s: float) -> Check:
    what, routing = "prefix_cache", model.routing
    where = f"models.{model.name}.routing"
    req = urllib.request.Request(base + "/metrics")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return check(what, "FAIL", f"GET /metrics: HTTP {e.code}")
    except (OSError, ValueError) as e:
        raise _Unreachable(str(getattr(e, "reason", None) or e)) from None
    line = next((x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")), None)
    if line is None:
        return check(what, "FAIL", "GET /metrics has no vllm:cache_config_info: is this a "
                                   "vLLM server? prefix routing needs its block size and "
                                   "hash algorithm")
    labels = dict(_LABEL.findall(line[:line.rfind("}")]))
    wrong = []
    if labels.get("enable_prefix_caching") != "True":
        wrong.append(f"prefix caching is off (enable_prefix_caching "
                     f"{labels.get('enable_prefix_caching')}): start vLLM with "
                     "--enable-prefix-caching, or set the policy to least_outstanding")
    if labels.get("block_size") != str(routing.block_size):
        wrong.append(f"its --block-size is {labels.get('block_size')}, {where}.block_size "
                     f"is {routing.block_size}")
    if labels.get("prefix_caching_hash_algo") != routing.hash_algo:
        wrong.append(f"its --prefix-caching-hash-algo is "
                     f"{labels.get('prefix_caching_hash_algo')}, {where}.hash_algo is "
                     f"{routing.hash_algo}")
    if wrong:
        return check(what, "FAIL", "; ".join(wrong) + ": the counter's block hashes would "
                                   "never match the replica's")
    return check(what, "OK", f"prefix caching on, blocks of {routing.block_size} tokens, "
                             f"{routing.hash_algo} hashes, as {where} says")


def _kv_events(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
               base: str, endpoint: str, counter: ModelCounter | str,
               timeout_s: float) -> Check:
    """The ``kv_events`` check (module docstring): the probe's ``BlockStored`` hashes
    against the counter's, compared by ``kv_index.key_of`` (vLLM publishes 32-byte
    hashes or, by default, their low 64 bits as integers)."""
    import secrets

    import msgspec
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from tokengate import prefix_hash
    from tokengate.counter import kv_index
    from tokengate.counter.errors import BadRequest

    what = "kv_events"
    if isinstance(counter, str):
        return check(what, "FAIL", f"the counter cannot load models.{model.name}.dir: "
                                   f"{counter}")
    bs = model.routing.block_size
    vocab = counter.tokenizer.vocab_size
    # a prompt no cache holds yet: its blocks are stored (and published) by this probe
    prompt = [1000 + secrets.randbelow(max(vocab - 2000, 1)) for _ in range(2 * bs + 1)]
    try:
        reply = counter.count("completions", {"model": model.name, "prompt": prompt})
    except BadRequest as e:
        return check(what, "FAIL", f"the counter refused the probe: {e}")
    full = prefix_hash.block_hashes(prompt, bs, model.routing.hash_algo,
                                    model.routing.hash_seed)
    if reply.block_hashes != b"".join(h[:prefix_hash.PREFIX_BYTES] for h in full):
        return check(what, "FAIL", "the counter's block hashes are not prefix_hash's: a "
                                   "bug, report it")
    want = [kv_index.key_of(h) for h in full]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        if not monitor.poll(int(KV_EVENTS_WAIT_S * 1000)):
            return check(what, "FAIL", f"nothing listens on {endpoint} after "
                                       f"{KV_EVENTS_WAIT_S:g} s: start vLLM with "
                                       "--kv-events-config '{\"enable_kv_cache_events\": "
                                       "true, \"publisher\": \"zmq\", \"endpoint\": "
                                       f"\"tcp://*:{endpoint.rpartition(':')[2]}\"}}'")
        recv_monitor_message(monitor)
        time.sleep(0.3)  # the subscription reaches the publisher (a SUB misses the rest)
        a = _http("POST", base + "/v1/completions",
                  {"model": model.name, "prompt": prompt, "max_tokens": 1}, timeout_s,
                  {"X-Request-Id": f"{DOCTOR_PROBE_PREFIX}{uuid.uuid4().hex}"})
        if a.status != 200:
            return check(what, "FAIL", f"the completions probe got {_why(a)}")
        decode = msgspec.msgpack.Decoder(kv_index.EventBatch).decode
        event = msgspec.msgpack.Decoder(kv_index.Event).decode
        seen = 0
        deadline = time.monotonic() + KV_EVENTS_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            if not sub.poll(int(left * 1000)):
                break
            frames = sub.recv_multipart()
            seen += 1
            try:
                raws = decode(frames[-1]).events if len(frames) == 3 else []
            except msgspec.DecodeError:
                continue
            for raw in raws:
                try:
                    ev = event(raw)
                except msgspec.DecodeError:
                    continue
                # the probe's first block, whatever hashes it came with
                if not isinstance(ev, kv_index.BlockStored) or ev.token_ids[:bs] != prompt[:bs]:
                    continue
                try:
                    theirs = [kv_index.key_of(h) for h in ev.block_hashes]
                except ValueError:
                    theirs = []
                if theirs[:2] == want:
                    return check(what, "OK", f"{endpoint} published the probe's 2 blocks "
                                             "with the counter's hashes")
                return check(what, "FAIL", f"{endpoint} published the probe's blocks with "
                                           "other hashes than the counter's: is "
                                           f"models.{model.name}.routing.hash_seed the "
                                           "replica's PYTHONHASHSEED (null: none set)?")
        why = f"{seen} message(s), none about the probe" if seen else "no event"
        return check(what, "FAIL", f"{why} from {endpoint} within {KV_EVENTS_WAIT_S:g} s of "
                                   "the probe: is this the endpoint of this replica's "
                                   "--kv-events-config?")
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)
        ctx.term()


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
                if _http("GET", f"http://{u}/health", None, 2.0).status == 200:
                    pending.discard(u)
            except _Unreachable:
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
    engine = list(cfg.ledger.engine_usage_files) if engine_records else None
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


def summary(checks: list[Check]) -> str:
    """``N upstream(s): a OK, b warning(s), c failed, d skipped``"""
    n = len({(c.model, c.upstream) for c in checks})
    by = {s: sum(c.status == s for c in checks) for s in ("OK", "WARN", "FAIL", "SKIP")}
    return (f"{n} upstream(s): {by['OK']} OK, {by['WARN']} warning(s), {by['FAIL']} failed, "
            f"{by['SKIP']} skipped")
