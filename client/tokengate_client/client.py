"""The client SDK: the official ``openai`` client with pacing, billed usage and the
adaptive streaming buffer (``tokengate_client`` re-exports what is public here).

``Client`` (threads) and ``AsyncClient`` (asyncio) have the openai client's call shapes,
``client.chat.completions.create(...)`` and ``client.completions.create(...)``, and
return the answer with what the gateway billed (``Completion``), or for ``stream=True``
an iterator of the answer's chunks that keeps the running usage (``CompletionStream``).
``client.stream_text(...)`` yields the text of a chat answer in readable pieces
(``tokengate_client.buffer``). HTTP, retries of other errors and the API types are the
openai client's; only 429s are handled here: never a blind backoff, always the wait the
gateway gave (``tokengate_client.pacing``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import openai
from openai.types import CompletionUsage

from tokengate_client.buffer import TextBuffer, buffer_size
from tokengate_client.counting import Estimate, PromptCounter
from tokengate_client.pacing import Pacer, RateLimits, Ticket

if TYPE_CHECKING:  # the tokengate package is needed only to count offline (counting)
    from tokengate import config as tg_config

R = TypeVar("R")
DEFAULT_FIRST_PIECE_MS = 50.0
_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


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
    (pacing and ``Retry-After``).
    """

    token_count: int | None = None
    rate_limits: RateLimits | None = None
    rate_limited: int = 0
    waited_s: float = 0.0


@dataclass
class Completion(Generic[R]):
    """A whole answer: ``response`` (the openai ``ChatCompletion`` or ``Completion``),
    ``usage`` (what was billed: prompt, completion and total tokens) and ``billing``."""

    response: R
    usage: CompletionUsage | None
    billing: Billing = field(default_factory=Billing)

    @property
    def token_count(self) -> int | None:
        return self.billing.token_count


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _stream_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Streams ask for cumulative usage in every chunk (what ``usage`` follows and the
    pacer settles with), unless the caller chose its own ``stream_options``."""
    if kwargs.get("stream") and kwargs.get("stream_options") is None:
        return {**kwargs, "stream_options": dict(_STREAM_OPTIONS)}
    return kwargs


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

    def admitted(self, ticket: Ticket | None, headers: Mapping[str, str]) -> Billing:
        limits = RateLimits.from_headers(headers)
        if self.pacer is not None and ticket is not None:
            self.pacer.admitted(ticket, limits)
        return Billing(_int(headers.get("x-token-count")), limits)

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

    def settle(self, ticket: Ticket | None, usage: CompletionUsage | None) -> None:
        if self.pacer is not None and ticket is not None and usage is not None:
            self.pacer.settle(ticket, usage.prompt_tokens + usage.completion_tokens)


def _expected_tokens(kwargs: dict[str, Any], est: Estimate | None) -> int:
    """The completion budget the buffer size follows (tokens)."""
    for k in ("max_completion_tokens", "max_tokens"):
        if isinstance(kwargs.get(k), int):
            return int(kwargs[k])
    return est.completion_budget if est else 0


def _delta_text(chunk: Any) -> str:
    """The text a chunk adds (first choice): chat ``delta.content`` or completions
    ``text``."""
    choices = getattr(chunk, "choices", None) or []
    if not choices:
        return ""
    delta = getattr(choices[0], "delta", None)
    text = getattr(delta, "content", None) if delta is not None else \
        getattr(choices[0], "text", None)
    return text or ""


# -- sync -------------------------------------------------------------------------------

class _Settles:
    """What ``CompletionStream`` and ``AsyncCompletionStream`` share: the running usage
    of the chunks seen, and one settlement of the pacer's ticket when the stream ends."""

    _core: _Core
    _ticket: Ticket | None
    _ended: bool
    usage: CompletionUsage | None

    def _seen(self, chunk: Any) -> Any:
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        return chunk

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._core.settle(self._ticket, self.usage)


class CompletionStream(_Settles, Iterator[Any]):
    """The chunks of a streamed answer (openai ``ChatCompletionChunk`` or completions
    chunks). ``usage`` is the running usage (cumulative: the last chunk's), the billed
    one once the stream ended; ``billing`` as for ``Completion``. Closing it (or leaving
    its ``with`` block) ends the request; the gateway bills what was generated."""

    def __init__(self, stream: openai.Stream[Any], core: _Core, ticket: Ticket | None,
                 billing: Billing) -> None:
        self._stream, self._it = stream, iter(stream)
        self._core, self._ticket = core, ticket
        self.billing = billing
        self.usage: CompletionUsage | None = None
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


class _Pieces:
    """What ``TextStream`` and ``AsyncTextStream`` share: one queued item (a chunk, the
    end, or the reader's exception) through the buffer."""

    _buffer: TextBuffer
    _done: bool
    usage: CompletionUsage | None

    def _take(self, item: Any, now: float) -> str | None:
        """The piece ``item`` completes (None: none yet); raises the reader's exception."""
        if item is _END:
            self._done = True
            return self._buffer.end()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if getattr(item, "usage", None) is not None:
            self.usage = item.usage
        return self._buffer.feed(_delta_text(item), now)


class TextStream(_Pieces, Iterator[str]):
    """``stream_text``'s pieces (``tokengate_client.buffer`` rules); ``usage``: the
    running usage of the text yielded so far; ``billing`` as for ``Completion``.

    A reader thread takes the chunks off the connection, so that the first piece's time
    bound holds even while the server is silent."""

    def __init__(self, stream: CompletionStream, buffer: TextBuffer) -> None:
        self._stream, self._buffer = stream, buffer
        self.billing = stream.billing
        self.usage: CompletionUsage | None = None
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
    def __init__(self, client: Client, endpoint: str) -> None:
        self._client, self._endpoint = client, endpoint

    def create(self, **kwargs: Any) -> Any:
        """As the openai client's ``create``; returns ``Completion`` or, with
        ``stream=True``, ``CompletionStream``."""
        est = self._client._core.estimate(self._endpoint, kwargs)
        return self._client._call(self._endpoint, kwargs, est)


class _Chat:
    def __init__(self, client: Client) -> None:
        self.completions = _Create(client, "chat")


class Client:
    """The openai client with tokengate's pacing (see the module's docstring).

    ``config``: the gateway's ``tokengate.yaml`` (path or loaded ``Config``): prompts are
    counted with its models' tokenizers and chat templates, so that a request waits
    until the key's limits admit it; None: no counting, so no waiting before sending
    (429s are still waited out exactly). ``pacing=False``: send at once, wait out 429s.
    ``margin_tokens``: TPM left unused by pacing (None: one second of the key's TPM).
    ``first_piece_ms``: ``stream_text``'s time bound for its first piece. Every other
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
        self.completions = _Create(self, "completions")

    def _call(self, endpoint: str, kwargs: dict[str, Any], est: Estimate | None) -> Any:
        core = self._core
        kwargs = _stream_kwargs(kwargs)
        resource = self.openai.chat.completions if endpoint == "chat" else self.openai.completions
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
        billing = core.admitted(ticket, raw.headers)
        billing.rate_limited, billing.waited_s = refused, waited
        parsed = raw.parse()
        if kwargs.get("stream"):
            return CompletionStream(parsed, core, ticket, billing)
        core.settle(ticket, parsed.usage)
        return Completion(parsed, parsed.usage, billing)

    def stream_text(self, **kwargs: Any) -> TextStream:
        """A chat answer's text in pieces: ``create(stream=True, ...)`` (same
        arguments) through the adaptive buffer, sized by ``max_tokens`` (or the budget
        the prompt leaves)."""
        est = self._core.estimate("chat", kwargs)
        stream = self._call("chat", {**kwargs, "stream": True}, est)
        size = buffer_size(_expected_tokens(kwargs, est))
        return TextStream(stream, TextBuffer(size, self.first_piece_s))

    def close(self) -> None:
        self.openai.close()


# -- async ------------------------------------------------------------------------------

class AsyncCompletionStream(_Settles, AsyncIterator[Any]):
    """``CompletionStream`` for ``AsyncClient``."""

    def __init__(self, stream: openai.AsyncStream[Any], core: _Core, ticket: Ticket | None,
                 billing: Billing) -> None:
        self._stream, self._it = stream, stream.__aiter__()
        self._core, self._ticket = core, ticket
        self.billing = billing
        self.usage: CompletionUsage | None = None
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


class AsyncTextStream(_Pieces, AsyncIterator[str]):
    """``TextStream`` for ``AsyncClient``: a task takes the chunks off the connection."""

    def __init__(self, stream: AsyncCompletionStream, buffer: TextBuffer) -> None:
        self._stream, self._buffer = stream, buffer
        self.billing = stream.billing
        self.usage: CompletionUsage | None = None
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
    def __init__(self, client: AsyncClient, endpoint: str) -> None:
        self._client, self._endpoint = client, endpoint

    async def create(self, **kwargs: Any) -> Any:
        """As the openai client's ``create``; returns ``Completion`` or, with
        ``stream=True``, ``AsyncCompletionStream``."""
        est = self._client._core.estimate(self._endpoint, kwargs)
        return await self._client._call(self._endpoint, kwargs, est)


class _AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = _AsyncCreate(client, "chat")


class AsyncClient:
    """``Client`` for asyncio (same arguments; the openai ``AsyncOpenAI`` underneath).
    The pacer is shared by every task using the client: concurrent calls wait their
    turn instead of overrunning the key together."""

    def __init__(self, *, config: str | Path | tg_config.Config | None = None,
                 pacing: bool = True, margin_tokens: float | None = None,
                 first_piece_ms: float = DEFAULT_FIRST_PIECE_MS, **openai_kwargs: Any) -> None:
        self.openai = _AsyncOpenAI(**openai_kwargs)
        self._core = _Core(config, pacing, margin_tokens, self.openai.max_retries)
        self.first_piece_s = first_piece_ms / 1000
        self.chat = _AsyncChat(self)
        self.completions = _AsyncCreate(self, "completions")

    async def _call(self, endpoint: str, kwargs: dict[str, Any], est: Estimate | None) -> Any:
        core = self._core
        kwargs = _stream_kwargs(kwargs)
        resource = self.openai.chat.completions if endpoint == "chat" else self.openai.completions
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
        billing = core.admitted(ticket, raw.headers)
        billing.rate_limited, billing.waited_s = refused, waited
        parsed = raw.parse()
        if kwargs.get("stream"):
            return AsyncCompletionStream(parsed, core, ticket, billing)
        core.settle(ticket, parsed.usage)
        return Completion(parsed, parsed.usage, billing)

    async def stream_text(self, **kwargs: Any) -> AsyncTextStream:
        """``Client.stream_text`` for asyncio (``async for piece in await ...``)."""
        est = self._core.estimate("chat", kwargs)
        stream = await self._call("chat", {**kwargs, "stream": True}, est)
        size = buffer_size(_expected_tokens(kwargs, est))
        return AsyncTextStream(stream, TextBuffer(size, self.first_piece_s))

    async def close(self) -> None:
        await self.openai.close()
