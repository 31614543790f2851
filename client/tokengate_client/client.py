"""The client SDK: the official ``openai`` client with pacing, billed usage and the
adaptive streaming buffer (``tokengate_client`` re-exports what is public here).

``Client`` (threads) and ``AsyncClient`` (asyncio) have the openai client's call shapes,
``client.chat.completions.create(...)``, ``client.completions.create(...)``,
``client.responses.create(...)`` (the OpenAI Responses API) and
``client.embeddings.create(...)`` (a pooling model's), and return the answer with
what the gateway billed (``Completion``), or for ``stream=True`` an iterator of the
answer's chunks or events that keeps the usage (``CompletionStream``).
``client.stream_text(...)`` (chat) and ``client.responses.stream_text(...)`` yield the
text of an answer in readable pieces (``tokengate_client.buffer``). HTTP, retries of
other errors and the API types are the openai client's; only 429s are handled here:
never a blind backoff, always the wait the gateway gave (``tokengate_client.pacing``).

What differs between the three APIs (the counter's endpoint, the openai resource, the
completion budget's field, the text and the usage of a streamed item) is one ``_Api``
value each; pacing, the 429 rule, settling and the buffer are the same code for all.

(Long for one thing: the threaded and the asyncio client mirror each other method for
method over the shared core, and stay side by side so that a change to one is seen to
need the other.)
"""

from __future__ import annotations

import asyncio
import operator
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import openai
from openai.types import CompletionUsage
from openai.types.create_embedding_response import Usage as EmbeddingUsage
from openai.types.responses import ResponseUsage

from tokengate_client.buffer import TextBuffer, buffer_size
from tokengate_client.counting import Estimate, PromptCounter
from tokengate_client.pacing import Pacer, RateLimits, Ticket

if TYPE_CHECKING:  # the tokengate package is needed only to count offline (counting)
    from tokengate import config as tg_config

R = TypeVar("R")
Usage = CompletionUsage | ResponseUsage | EmbeddingUsage
U = TypeVar("U", bound=Usage)
DEFAULT_FIRST_PIECE_MS = 50.0
_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# the Responses stream events whose response carries the final usage (vLLM sends
# response.completed for an incomplete response too)
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class _OpenAI(openai.OpenAI):
    def _should_retry(self, response: Any) -> bool:
        # a 429 is the pacer's to wait out (Retry-After exactly), never backed off
        return bool(response.status_code != 429 and super()._should_retry(response))


class _AsyncOpenAI(openai.AsyncOpenAI):
    def _should_retry(self, response: Any) -> bool:
        return bool(response.status_code != 429 and super()._should_retry(response))


@dataclass
class Billing:
    """What the gateway said about one call.

    ``token_count``: its ``X-Token-Count`` (the prompt tokens it counted; None without
    one); ``rate_limits``: the ``x-ratelimit-*`` headers of the answer; ``rate_limited``:
    429s answered before it was admitted; ``waited_s``: seconds spent waiting first
    (pacing and ``Retry-After``); ``request_id``: its ``X-Request-Id`` (the usage
    event's and the ledger's id of the call); ``estimate``: the client's own count
    before sending (prompt tokens, completion budget, TPM reservation; None when it
    counted nothing: no ``config``, or a body it cannot count).
    """

    token_count: int | None = None
    rate_limits: RateLimits | None = None
    rate_limited: int = 0
    waited_s: float = 0.0
    request_id: str | None = None
    estimate: Estimate | None = None


@dataclass
class Completion(Generic[R]):
    """A whole answer: ``response`` (the openai ``ChatCompletion``, ``Completion`` or
    ``Response``), ``usage`` (what was billed: ``CompletionUsage``, prompt, completion
    and total tokens, for chat and completions; ``ResponseUsage``, input, output and
    total tokens with ``input_tokens_details.cached_tokens``, for responses) and
    ``billing``."""

    response: R
    usage: CompletionUsage | ResponseUsage | EmbeddingUsage | None
    billing: Billing = field(default_factory=Billing)

    @property
    def token_count(self) -> int | None:
        return self.billing.token_count


def billed_tokens(usage: Usage) -> int:
    """Tokens a usage bills against the key's TPM, as the edge settles it: chat and
    completions ``prompt_tokens + completion_tokens``, Responses ``input_tokens +
    output_tokens`` (cached input tokens are part of ``input_tokens``), embeddings
    ``prompt_tokens`` (nothing generated)."""
    if isinstance(usage, ResponseUsage):
        return usage.input_tokens + usage.output_tokens
    if isinstance(usage, EmbeddingUsage):
        return usage.prompt_tokens
    return usage.prompt_tokens + usage.completion_tokens


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _choice_text(chunk: Any) -> str:
    """The text a chat or completions chunk adds (first choice): chat
    ``delta.content`` or completions ``text``."""
    choices = getattr(chunk, "choices", None) or []
    if not choices:
        return ""
    delta = getattr(choices[0], "delta", None)
    text = getattr(delta, "content", None) if delta is not None else \
        getattr(choices[0], "text", None)
    return text or ""


def _chunk_usage(chunk: Any) -> CompletionUsage | None:
    """A chat or completions chunk's cumulative usage (None in chunks without one)."""
    usage: CompletionUsage | None = getattr(chunk, "usage", None)
    return usage


def _event_text(event: Any) -> str:
    """The text a Responses stream event adds: ``response.output_text.delta``'s
    ``delta`` (every output message's text, as ``Response.output_text`` joins it)."""
    if getattr(event, "type", None) == "response.output_text.delta":
        return str(event.delta or "")
    return ""


def _event_usage(event: Any) -> ResponseUsage | None:
    """The final usage of a Responses stream: its ``response.completed`` (or
    ``.incomplete``, ``.failed``) event's ``response.usage``; None for every other
    event (the Responses stream has no running usage)."""
    if getattr(event, "type", None) not in _RESPONSE_ENDS:
        return None
    usage: ResponseUsage | None = getattr(event.response, "usage", None)
    return usage


@dataclass(frozen=True)
class _Api(Generic[U]):
    """One API the client paces: ``endpoint`` (the counter's name for it), ``resource``
    (the openai client's attribute path), ``budget`` (the body fields that give the
    completion budget, tokens, first set wins), ``text`` and ``usage`` (what a streamed
    item adds to the text, and the cumulative usage it carries), ``stream_options``
    (streams ask for cumulative usage in every chunk)."""

    endpoint: str
    resource: str
    budget: tuple[str, ...]
    text: Callable[[Any], str]
    usage: Callable[[Any], U | None]
    stream_options: bool

    def kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``create``'s arguments as sent: chat and completions streams ask for
        cumulative usage in every chunk (what ``usage`` follows and the pacer settles
        with), unless the caller chose its own ``stream_options``."""
        if self.stream_options and kwargs.get("stream") and \
                kwargs.get("stream_options") is None:
            return {**kwargs, "stream_options": dict(_STREAM_OPTIONS)}
        return kwargs

    def expected_tokens(self, kwargs: dict[str, Any], est: Estimate | None) -> int:
        """The completion budget the buffer size follows (tokens)."""
        for k in self.budget:
            if isinstance(kwargs.get(k), int):
                return int(kwargs[k])
        return est.completion_budget if est else 0


CHAT = _Api[CompletionUsage]("chat", "chat.completions",
                             ("max_completion_tokens", "max_tokens"),
                             _choice_text, _chunk_usage, True)
COMPLETIONS = _Api[CompletionUsage]("completions", "completions", ("max_tokens",),
                                    _choice_text, _chunk_usage, True)
RESPONSES = _Api[ResponseUsage]("responses", "responses", ("max_output_tokens",),
                                _event_text, _event_usage, False)
# embeddings stream nothing and generate nothing: the reservation is the prompt
EMBEDDINGS = _Api[EmbeddingUsage]("embeddings", "embeddings", (), _event_text,
                                  lambda _item: None, False)


class _Core:
    """What the sync and async clients share: counting, the pacer, the 429 rule."""

    def __init__(self, config: str | Path | tg_config.Config | None, pacing: bool,
                 margin_tokens: float | None, max_retries: int) -> None:
        self.counter = None if config is None else PromptCounter.of(config)
        self.pacer = Pacer(margin_tokens) if pacing else None
        self.max_retries = max_retries

    def estimate(self, endpoint: str, kwargs: dict[str, Any]) -> Estimate | None:
        return self.counter.estimate(endpoint, kwargs) if self.counter else None

    def acquire(self, est: Estimate | None) -> tuple[float, Ticket | None]:
        if self.pacer is None:
            return 0.0, None
        return self.pacer.acquire(est.reservation if est else None)

    def admitted(self, ticket: Ticket | None, headers: Mapping[str, str],
                 est: Estimate | None) -> Billing:
        limits = RateLimits.from_headers(headers)
        if self.pacer is not None and ticket is not None:
            self.pacer.admitted(ticket, limits)
        return Billing(_int(headers.get("x-token-count")), limits,
                       request_id=headers.get("x-request-id"), estimate=est)

    def rejected(self, ticket: Ticket | None, est: Estimate | None,
                 error: openai.APIStatusError, tries: int) -> float | None:
        """Seconds to wait before trying again, or None to raise ``error``: a 429 is
        retried ``max_retries`` times, each after its ``Retry-After``, unless the
        request alone exceeds the key's TPM; other statuses (the openai client already
        retried what it retries) give the reservation back and raise."""
        limits = RateLimits.from_headers(error.response.headers)
        wait = self.pacer.refused(ticket, limits) if self.pacer and ticket else None
        if error.status_code != 429 or tries >= self.max_retries:
            return None
        if est is not None and limits is not None and est.reservation > limits.limit_tokens:
            return None
        if wait is None:
            wait = limits.retry_after_s if limits and limits.retry_after_s is not None else 1.0
        return wait

    def settle(self, ticket: Ticket | None, usage: Usage | None) -> None:
        if self.pacer is not None and ticket is not None and usage is not None:
            self.pacer.settle(ticket, billed_tokens(usage))


# -- sync -------------------------------------------------------------------------------

class _Settles(Generic[U]):
    """What ``CompletionStream`` and ``AsyncCompletionStream`` share: the usage of the
    items seen (the last one's wins), and one settlement of the pacer's ticket when the
    stream ends."""

    _api: _Api[U]
    _core: _Core
    _ticket: Ticket | None
    _ended: bool
    usage: U | None

    def _seen(self, item: Any) -> Any:
        usage = self._api.usage(item)
        if usage is not None:
            self.usage = usage
        return item

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._core.settle(self._ticket, self.usage)


class CompletionStream(_Settles[U], Iterator[Any]):
    """The items of a streamed answer: openai ``ChatCompletionChunk``, completions
    chunks, or Responses stream events (``ResponseStreamEvent``). ``usage`` is the
    usage seen so far: chat and completions chunks carry a running one (cumulative: the
    last chunk's), a Responses stream only the final one, in ``response.completed``;
    it is what was billed once the stream ended. ``billing`` as for ``Completion``.
    Closing it (or leaving its ``with`` block) ends the request; the gateway bills what
    was generated."""

    def __init__(self, stream: openai.Stream[Any], core: _Core, ticket: Ticket | None,
                 billing: Billing, api: _Api[U]) -> None:
        self._stream, self._it = stream, iter(stream)
        self._api, self._core, self._ticket = api, core, ticket
        self.billing = billing
        self.usage: U | None = None
        self._ended = False

    def __next__(self) -> Any:
        try:
            chunk = next(self._it)
        except BaseException:
            self._end()
            raise
        return self._seen(chunk)

    def close(self) -> None:
        self._stream.close()
        self._end()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


class _Pieces(Generic[U]):
    """What ``TextStream`` and ``AsyncTextStream`` share: one queued item (a chunk or
    event, the end, or the reader's exception) through the buffer."""

    _api: _Api[U]
    _buffer: TextBuffer
    _done: bool
    usage: U | None

    def _take(self, item: Any, now: float) -> str | None:
        """The piece ``item`` completes (None: none yet); raises the reader's exception."""
        if item is _END:
            self._done = True
            return self._buffer.end()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        usage = self._api.usage(item)
        if usage is not None:
            self.usage = usage
        return self._buffer.feed(self._api.text(item), now)


class TextStream(_Pieces[U], Iterator[str]):
    """``stream_text``'s pieces (``tokengate_client.buffer`` rules); ``usage``: the
    usage of the text yielded so far (``CompletionUsage``, running, for chat;
    ``ResponseUsage`` for responses, set with the last piece, from
    ``response.completed``); ``billing`` as for ``Completion``.

    A reader thread takes the items off the connection, so that the first piece's time
    bound holds even while the server is silent."""

    def __init__(self, stream: CompletionStream[U], buffer: TextBuffer) -> None:
        self._stream, self._buffer, self._api = stream, buffer, stream._api
        self.billing = stream.billing
        self.usage: U | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._done = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for chunk in self._stream:
                self._queue.put(chunk)
            self._queue.put(_END)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._queue.put(e)

    def __next__(self) -> str:
        buf = self._buffer
        while not self._done:
            deadline = buf.deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                piece = buf.due(time.monotonic())
            else:
                piece = self._take(item, time.monotonic())
            if piece:
                return piece
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._stream.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Create:
    def __init__(self, client: Client, api: _Api[Any]) -> None:
        self._client, self._api = client, api

    def create(self, **kwargs: Any) -> Any:
        """As the openai client's ``create``; returns ``Completion`` or, with
        ``stream=True``, ``CompletionStream``."""
        est = self._client._core.estimate(self._api.endpoint, kwargs)
        return self._client._call(self._api, kwargs, est)


class _Chat:
    def __init__(self, client: Client) -> None:
        self.completions = _Create(client, CHAT)


class _Responses(_Create):
    """``client.responses``: the OpenAI Responses API (``POST /v1/responses``), paced
    as chat (the prompt counted as the edge counts a Responses body; the reservation is
    prompt + min(``max_output_tokens``, output_reserve))."""

    def __init__(self, client: Client) -> None:
        super().__init__(client, RESPONSES)

    def create(self, **kwargs: Any) -> Any:
        """As the openai client's ``responses.create``; returns ``Completion`` (the
        ``Response``, its ``ResponseUsage``) or, with ``stream=True``,
        ``CompletionStream`` of ``ResponseStreamEvent``, whose ``usage`` is
        ``response.completed``'s."""
        return super().create(**kwargs)

    def stream_text(self, **kwargs: Any) -> TextStream[ResponseUsage]:
        """A response's text in pieces: ``create(stream=True, ...)`` (same arguments)
        through the adaptive buffer, over its ``response.output_text.delta`` events,
        sized by ``max_output_tokens`` (or the budget the prompt leaves). ``usage``:
        the ``ResponseUsage`` of ``response.completed``."""
        return self._client._stream_text(RESPONSES, kwargs)


class Client:
    """The openai client with tokengate's pacing (see the module's docstring):
    ``chat.completions.create``, ``completions.create``, ``responses.create``,
    ``stream_text`` (chat) and ``responses.stream_text``.

    ``config``: the gateway's ``tokengate.yaml`` (path or loaded ``Config``): prompts are
    counted with its models' tokenizers and chat templates, so that a request waits
    until the key's limits admit it; None: no counting, so no waiting before sending
    (429s are still waited out exactly). ``pacing=False``: send at once, wait out 429s.
    ``margin_tokens``: TPM left unused by pacing (None: one second of the key's TPM).
    ``first_piece_ms``: the text streams' time bound for their first piece. Every other
    keyword (``base_url``, ``api_key``, ``timeout``, ``max_retries``, ...) is the
    openai client's; ``max_retries`` also bounds the 429s waited out per call.
    """

    def __init__(self, *, config: str | Path | tg_config.Config | None = None,
                 pacing: bool = True, margin_tokens: float | None = None,
                 first_piece_ms: float = DEFAULT_FIRST_PIECE_MS, **openai_kwargs: Any) -> None:
        self.openai = _OpenAI(**openai_kwargs)
        self._core = _Core(config, pacing, margin_tokens, self.openai.max_retries)
        self.first_piece_s = first_piece_ms / 1000
        self.chat = _Chat(self)
        self.completions = _Create(self, COMPLETIONS)
        self.responses = _Responses(self)
        self.embeddings = _Create(self, EMBEDDINGS)

    def _call(self, api: _Api[U], kwargs: dict[str, Any], est: Estimate | None) -> Any:
        core = self._core
        kwargs = api.kwargs(kwargs)
        resource = operator.attrgetter(api.resource)(self.openai)
        waited, refused = 0.0, 0
        while True:
            wait, ticket = core.acquire(est)
            if wait > 0:
                time.sleep(wait)
                waited += wait
                continue
            try:
                raw = resource.with_raw_response.create(**kwargs)
                break
            except openai.APIStatusError as e:
                wait_s = core.rejected(ticket, est, e, refused)
                if wait_s is None:
                    raise
                refused += 1
                time.sleep(wait_s)
                waited += wait_s
        billing = core.admitted(ticket, raw.headers, est)
        billing.rate_limited, billing.waited_s = refused, waited
        parsed = raw.parse()
        if kwargs.get("stream"):
            return CompletionStream(parsed, core, ticket, billing, api)
        core.settle(ticket, parsed.usage)
        return Completion(parsed, parsed.usage, billing)

    def _stream_text(self, api: _Api[U], kwargs: dict[str, Any]) -> TextStream[U]:
        est = self._core.estimate(api.endpoint, kwargs)
        stream: CompletionStream[U] = self._call(api, {**kwargs, "stream": True}, est)
        size = buffer_size(api.expected_tokens(kwargs, est))
        return TextStream(stream, TextBuffer(size, self.first_piece_s))

    def stream_text(self, **kwargs: Any) -> TextStream[CompletionUsage]:
        """A chat answer's text in pieces: ``chat.completions.create(stream=True, ...)``
        (same arguments) through the adaptive buffer, sized by ``max_tokens`` (or the
        budget the prompt leaves). ``responses.stream_text`` does the same for the
        Responses API."""
        return self._stream_text(CHAT, kwargs)

    def close(self) -> None:
        self.openai.close()


# -- async ------------------------------------------------------------------------------

class AsyncCompletionStream(_Settles[U], AsyncIterator[Any]):
    """``CompletionStream`` for ``AsyncClient``."""

    def __init__(self, stream: openai.AsyncStream[Any], core: _Core, ticket: Ticket | None,
                 billing: Billing, api: _Api[U]) -> None:
        self._stream, self._it = stream, stream.__aiter__()
        self._api, self._core, self._ticket = api, core, ticket
        self.billing = billing
        self.usage: U | None = None
        self._ended = False

    async def __anext__(self) -> Any:
        try:
            chunk = await self._it.__anext__()
        except BaseException:
            self._end()
            raise
        return self._seen(chunk)

    async def close(self) -> None:
        await self._stream.close()
        self._end()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncTextStream(_Pieces[U], AsyncIterator[str]):
    """``TextStream`` for ``AsyncClient``: a task takes the items off the connection."""

    def __init__(self, stream: AsyncCompletionStream[U], buffer: TextBuffer) -> None:
        self._stream, self._buffer, self._api = stream, buffer, stream._api
        self.billing = stream.billing
        self.usage: U | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._done = False
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for chunk in self._stream:
                self._queue.put_nowait(chunk)
            self._queue.put_nowait(_END)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._queue.put_nowait(e)

    async def __anext__(self) -> str:
        buf = self._buffer
        loop = asyncio.get_running_loop()
        while not self._done:
            deadline = buf.deadline()
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
                piece = buf.due(loop.time())
            else:
                piece = self._take(item, loop.time())
            if piece:
                return piece
        raise StopAsyncIteration

    async def close(self) -> None:
        self._done = True
        self._reader.cancel()
        await self._stream.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _AsyncCreate:
    def __init__(self, client: AsyncClient, api: _Api[Any]) -> None:
        self._client, self._api = client, api

    async def create(self, **kwargs: Any) -> Any:
        """As the openai client's ``create``; returns ``Completion`` or, with
        ``stream=True``, ``AsyncCompletionStream``."""
        est = self._client._core.estimate(self._api.endpoint, kwargs)
        return await self._client._call(self._api, kwargs, est)


class _AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = _AsyncCreate(client, CHAT)


class _AsyncResponses(_AsyncCreate):
    """``_Responses`` for ``AsyncClient``."""

    def __init__(self, client: AsyncClient) -> None:
        super().__init__(client, RESPONSES)

    async def create(self, **kwargs: Any) -> Any:
        """As the openai client's ``responses.create``; returns ``Completion`` or, with
        ``stream=True``, ``AsyncCompletionStream`` of ``ResponseStreamEvent``."""
        return await super().create(**kwargs)

    async def stream_text(self, **kwargs: Any) -> AsyncTextStream[ResponseUsage]:
        """``Client.responses.stream_text`` for asyncio (``async for piece in await
        ...``)."""
        return await self._client._stream_text(RESPONSES, kwargs)


class AsyncClient:
    """``Client`` for asyncio (same arguments and calls; the openai ``AsyncOpenAI``
    underneath). The pacer is shared by every task using the client: concurrent calls
    wait their turn instead of overrunning the key together."""

    def __init__(self, *, config: str | Path | tg_config.Config | None = None,
                 pacing: bool = True, margin_tokens: float | None = None,
                 first_piece_ms: float = DEFAULT_FIRST_PIECE_MS, **openai_kwargs: Any) -> None:
        self.openai = _AsyncOpenAI(**openai_kwargs)
        self._core = _Core(config, pacing, margin_tokens, self.openai.max_retries)
        self.first_piece_s = first_piece_ms / 1000
        self.chat = _AsyncChat(self)
        self.completions = _AsyncCreate(self, COMPLETIONS)
        self.responses = _AsyncResponses(self)
        self.embeddings = _AsyncCreate(self, EMBEDDINGS)

    async def _call(self, api: _Api[U], kwargs: dict[str, Any], est: Estimate | None) -> Any:
        core = self._core
        kwargs = api.kwargs(kwargs)
        resource = operator.attrgetter(api.resource)(self.openai)
        waited, refused = 0.0, 0
        while True:
            wait, ticket = core.acquire(est)
            if wait > 0:
                await asyncio.sleep(wait)
                waited += wait
                continue
            try:
                raw = await resource.with_raw_response.create(**kwargs)
                break
            except openai.APIStatusError as e:
                wait_s = core.rejected(ticket, est, e, refused)
                if wait_s is None:
                    raise
                refused += 1
                await asyncio.sleep(wait_s)
                waited += wait_s
        billing = core.admitted(ticket, raw.headers, est)
        billing.rate_limited, billing.waited_s = refused, waited
        parsed = raw.parse()
        if kwargs.get("stream"):
            return AsyncCompletionStream(parsed, core, ticket, billing, api)
        core.settle(ticket, parsed.usage)
        return Completion(parsed, parsed.usage, billing)

    async def _stream_text(self, api: _Api[U], kwargs: dict[str, Any]) -> AsyncTextStream[U]:
        est = self._core.estimate(api.endpoint, kwargs)
        stream: AsyncCompletionStream[U] = await self._call(api, {**kwargs, "stream": True},
                                                            est)
        size = buffer_size(api.expected_tokens(kwargs, est))
        return AsyncTextStream(stream, TextBuffer(size, self.first_piece_s))

    async def stream_text(self, **kwargs: Any) -> AsyncTextStream[CompletionUsage]:
        """``Client.stream_text`` for asyncio (``async for piece in await ...``)."""
        return await self._stream_text(CHAT, kwargs)

    async def close(self) -> None:
        await self.openai.close()
