"""Rendering a chat template once per conversation shape: traces.

A chat client resends the whole history each turn, so the counter renders the same
template over ever longer conversations; with jinja2 that costs ~6 µs per message
(~70 µs for a 10-turn conversation on a 2-core Xeon, ``make bench-counter``), however
much of it the segment cache already knows. A trace renders a conversation *shape* once
and assembles later conversations of that shape from it, exactly:

- The shape (``shape_key``) is what the template may read besides message contents:
  the roles in order and the request's template arguments (scalars only). A
  conversation qualifies when every message is a plain ``{"role": str, "content":
  str}`` (what ``counting.ModelCounter._message`` gives the common message) and there
  are no tools.
- Recording renders the template once with each content replaced by a ``_Probe``: a
  ``str`` whose text is a placeholder (``\\ue000<i>\\ue001``, private-use characters)
  and which answers every question the template asks about it from the real content.
  Questions whose answer is one bit about the content (``in``, ``startswith``,
  ``endswith``, ``==``, ``!=``, truth) are recorded with their answers; any other use
  that reads the content (``split``, ``strip``, ``len``, slicing, a filter, a hash,
  ...) *spoils* the trace: the content then reaches the output by a way a placeholder
  cannot stand for. Concatenation and output keep the placeholder, which is what a
  trace replaces.
- A later conversation of the same shape uses the trace when every recorded question
  gets the same answer from its contents: the template would then take the same
  branches and emit the same text with the contents in the placeholders' places.
  Other answers are recorded afresh (``TraceCache``).

Where the probe cannot see a use, the template is not traced at all
(``traceable``): a method called with an argument that is no constant (``x.find(y)``
would read a placeholder's text without asking it), or ``a in b`` with ``a`` no
constant and ``b`` no literal list (``str.__contains__`` reads ``a``'s text itself).
Nor is a template that calls a global whose answer changes (``strftime_now``).
Filters and tests are wrapped (``wrap_environment``) so that a probe reaching them
spoils the recording and they get the real content. Each trace is checked once against
the plain render of the conversation it was recorded from; a mismatch (which the rules
above should make impossible) is logged and that shape is rendered every time.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Self, cast

import jinja2
import jinja2.nodes

log = logging.getLogger(__name__)

_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
# jinja tests whose answer for a str depends on its type only
_TYPE_TESTS = frozenset({"defined", "undefined", "none", "string", "mapping", "sequence",
                         "iterable", "number", "integer", "float", "boolean", "true",
                         "false", "callable"})
# filters whose answer for a list or dict depends on its shape only (the shape key fixes
# the number of messages and their keys)
_SHAPE_FILTERS = frozenset({"length", "count"})
# globals whose answer changes from call to call: a template naming one is not traced
_IMPURE_GLOBALS = frozenset({"strftime_now", "lipsum"})
# str methods a probe answers and records: one bit about the content each
_QUESTIONS: dict[str, Callable[..., bool]] = {"startswith": str.startswith,
                                              "endswith": str.endswith}


class Recording:
    """What one probe render observed: the questions asked (``(message index, str
    function, arguments) -> answer``) and whether a use spoiled it."""

    def __init__(self) -> None:
        self.questions: dict[tuple[int, Callable[..., bool], tuple[Any, ...]], bool] = {}
        self.spoiled = False

    def ask(self, probe: _Probe, fn: Callable[..., bool], args: tuple[Any, ...]) -> bool:
        answer = bool(fn(probe.real, *args))
        self.questions[(probe.position, fn, args)] = answer
        return answer


def _real(v: Any) -> Any:
    """``v`` with every probe inside (lists, tuples, dicts) replaced by its content."""
    if isinstance(v, _Probe):
        return v.real
    if isinstance(v, (list, tuple)):
        return type(v)(_real(x) for x in v)
    if isinstance(v, dict):
        return {_real(k): _real(x) for k, x in v.items()}
    return v


class _Probe(str):
    """A message content during a recording: its ``str`` text is the placeholder of
    message ``position``; ``real`` is the content."""

    real: str
    position: int
    recording: Recording

    def __new__(cls, real: str, index: int, recording: Recording) -> Self:
        self = super().__new__(cls, f"{_OPEN}{index}{_CLOSE}")
        self.real, self.position, self.recording = real, index, recording
        return self

    def __contains__(self, x: object) -> bool:
        if type(x) is str:
            return self.recording.ask(self, str.__contains__, (x,))
        self.recording.spoiled = True
        return _real(x) in self.real

    def __eq__(self, other: object) -> bool:
        if type(other) is str:
            return self.recording.ask(self, str.__eq__, (other,))
        self.recording.spoiled = True
        return self.real == _real(other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __bool__(self) -> bool:
        return self.recording.ask(self, bool, ())

    def __hash__(self) -> int:
        self.recording.spoiled = True
        return hash(self.real)

    def __format__(self, spec: str) -> str:
        if spec:
            self.recording.spoiled = True
            return format(self.real, spec)
        return str(self)


def _question(name: str) -> Callable[..., Any]:
    fn = _QUESTIONS[name]

    def ask(self: _Probe, *args: Any) -> bool:
        if len(args) == 1 and (type(args[0]) is str or (
                type(args[0]) is tuple and all(type(a) is str for a in args[0]))):
            return self.recording.ask(self, fn, args)
        self.recording.spoiled = True
        return bool(fn(self.real, *_real(args)))
    return ask


def _spoiling(name: str) -> Callable[..., Any]:
    def use(self: _Probe, *args: Any, **kwargs: Any) -> Any:
        self.recording.spoiled = True
        return getattr(self.real, name)(*_real(args), **_real(kwargs))
    return use


# str's own methods keep the placeholder only where the result is the text itself
# (concatenation, str(), construction); everything else reads the content.
_KEEP = frozenset({"__add__", "__str__", "__new__", "__init__", "__getattribute__",
                   "__setattr__", "__delattr__", "__init_subclass__", "__subclasshook__",
                   "__dir__", "__reduce__", "__reduce_ex__", "__getstate__", "__class__",
                   "__doc__", "__sizeof__"})
for _name in dir(str):
    if _name in _KEEP or _name in _Probe.__dict__ or not callable(getattr(str, _name)):
        continue
    setattr(_Probe, _name, _question(_name) if _name in _QUESTIONS else _spoiling(_name))


class Trace:
    """A recorded render: the questions and their answers, and the output as pieces of
    text and message indexes (``text``). ``plan``: what the model's counter made of
    it (``tokengate.counter.segment_plan``), None until its first count."""

    def __init__(self, recording: Recording, output: str) -> None:
        self.questions = list(recording.questions.items())
        parts = _PLACEHOLDER.split(output)
        self.pieces: list[str | int] = [p if i % 2 == 0 else int(p)
                                        for i, p in enumerate(parts) if p or i % 2]
        self.plan: object = None

    def holds(self, contents: list[str]) -> bool:
        """Whether ``contents`` answer every recorded question the same."""
        for (i, fn, args), answer in self.questions:
            if bool(fn(contents[i], *args)) is not answer:
                return False
        return True

    def text(self, contents: list[str]) -> str:
        """The output for ``contents`` (a conversation of the trace's shape that
        ``holds``)."""
        return "".join([contents[p] if isinstance(p, int) else p for p in self.pieces])


class Rendered:
    """A template's output for one conversation: ``text``; when it was assembled from a
    trace, also that ``trace`` and the ``contents`` in it (the text is then joined at
    its first use: a counter that counts by the trace's segments never needs it)."""

    __slots__ = ("_text", "contents", "trace")

    def __init__(self, text: str | None, trace: Trace | None = None,
                 contents: list[str] | None = None) -> None:
        self._text, self.trace, self.contents = text, trace, contents

    @property
    def text(self) -> str:
        if self._text is None:
            assert self.trace is not None and self.contents is not None
            self._text = self.trace.text(self.contents)
        return self._text


Shape = tuple[tuple[str, ...], tuple[tuple[str, type, Any], ...]]


def shape_key(conversation: list[dict[str, Any]], args: dict[str, Any]) -> Shape | None:
    """The conversation's shape (roles, template arguments with their types), or None
    when it does not qualify for a trace (a message other than role and string content,
    a template argument that is no scalar, a placeholder character anywhere but in
    contents)."""
    roles = []
    for m in conversation:
        if type(m) is not dict or len(m) != 2 or type(m.get("content")) is not str:
            return None
        role = m.get("role")
        if type(role) is not str or _OPEN in role:
            return None
        roles.append(role)
    for v in args.values():
        if v is not None and type(v) not in (str, bool, int, float):
            return None
        if type(v) is str and _OPEN in v:
            return None
    # each value with its type: 0 == False and 1.0 == 1 in Python, but not to a
    # template's ``is false`` or ``is integer`` (Qwen3: ``enable_thinking is false``)
    return tuple(roles), tuple(sorted((k, type(v), v) for k, v in args.items()))


class _Untraced:
    """A shape without a trace: its last recording was spoiled (tried again every
    ``RETRY``-th conversation, which may give answers that do not spoil), or a trace
    differed from its render (never again: ``retry`` False)."""

    RETRY = 64

    def __init__(self, retry: bool) -> None:
        self.retry = retry
        self.renders = 0


class TraceCache:
    """Traces by shape, least recently used first out (``max_shapes``).

    A conversation whose answers differ from its shape's trace is rendered and recorded
    afresh; its trace replaces the old one, unless it spoiled (a content that the
    template split or stripped, say): then the old trace stays for the conversations it
    fits.
    """

    def __init__(self, max_shapes: int = 4096) -> None:
        self._max = max_shapes
        self._map: OrderedDict[Shape, Trace | _Untraced] = OrderedDict()
        # inserting, evicting, counting: a worker's frames and gRPC threads share it
        self._lock = threading.Lock()
        self.hits = 0  # conversations assembled from a trace
        self.recorded = 0  # conversations rendered and recorded
        self.plain = 0  # conversations rendered without a recording

    def count_plain(self) -> None:
        """One more conversation rendered without a recording (``plain``)."""
        with self._lock:
            self.plain += 1

    def render(self, key: Shape, conversation: list[dict[str, Any]],
               render: Callable[[list[dict[str, Any]]], str]) -> Rendered:
        """The template's output for ``conversation`` (of shape ``key``): from its
        trace, else by ``render`` (the template's own render of a conversation; raises
        a ``ValueError`` when the template raises), recording a trace. Raises what
        ``render`` raises."""
        contents = [m["content"] for m in conversation]
        entry = self._map.get(key)
        if isinstance(entry, Trace):
            if entry.holds(contents):
                with self._lock:
                    self.hits += 1
                try:
                    self._map.move_to_end(key)
                except KeyError:  # evicted meanwhile
                    pass
                return Rendered(None, entry, contents)
        elif entry is not None:
            entry.renders += 1
            if not entry.retry or entry.renders % _Untraced.RETRY:
                self.count_plain()
                return Rendered(render(conversation))
        plain = render(conversation)  # raises first, with the real contents
        recording = Recording()
        probes = [{"role": m["role"], "content": _Probe(m["content"], i, recording)}
                  for i, m in enumerate(conversation)]
        try:
            output = render(probes)
        except ValueError:  # e.g. a use that a probe cannot answer
            recording.spoiled = True
            output = ""
        new: Trace | _Untraced
        if recording.spoiled:
            new = entry if isinstance(entry, Trace) else _Untraced(retry=True)
        else:
            new = Trace(recording, output)
            if new.text(contents) != plain:
                log.warning("chat template trace differs from its render for %d messages; "
                            "that shape is rendered every time", len(conversation))
                new = _Untraced(retry=False)
        with self._lock:
            self._map[key] = new
            self.recorded += 1
            while len(self._map) > self._max:
                self._map.popitem(last=False)
        return Rendered(plain)


def traceable(root: jinja2.nodes.Template) -> str:
    """Why a template cannot be traced ("" when it can): a use of a value the probes
    would not see (see the module docstring), or a global whose answer changes from
    call to call (``strftime_now``)."""
    for name in root.find_all(jinja2.nodes.Name):
        if name.name in _IMPURE_GLOBALS:
            return f"line {name.lineno}: {name.name} changes from call to call"
    for call in root.find_all(jinja2.nodes.Call):
        if isinstance(call.node, jinja2.nodes.Getattr) and (
                call.dyn_args is not None or call.dyn_kwargs is not None
                or not all(_constant(a) for a in call.args)
                or not all(_constant(k.value) for k in call.kwargs)):
            return f"line {call.lineno}: method {call.node.attr} called with a variable"
    for cmp in root.find_all(jinja2.nodes.Compare):
        left: jinja2.nodes.Expr = cmp.expr
        for op in cmp.ops:
            if op.op in ("in", "notin") and not _constant(left) \
                    and not isinstance(op.expr, (jinja2.nodes.List, jinja2.nodes.Tuple,
                                                 jinja2.nodes.Dict)):
                return f"line {cmp.lineno}: 'in' with a variable on both sides"
            left = op.expr
    return ""


def _constant(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Const):
        return True
    if isinstance(node, (jinja2.nodes.Tuple, jinja2.nodes.List)):
        return all(_constant(x) for x in node.items)
    return False


def wrap_environment(env: jinja2.Environment) -> None:
    """Make ``env``'s filters and tests spoil a recording that passes them a probe, and
    give them the real contents (outside a recording nothing changes but one type check
    per argument)."""
    for name, f in list(env.filters.items()):
        env.filters[name] = _wrapped(f, shape_only=name in _SHAPE_FILTERS)
    for name, t in list(env.tests.items()):
        if name not in _TYPE_TESTS:
            env.tests[name] = _wrapped(cast(Callable[..., Any], t))


def _probes(v: Any, depth: int = 0) -> Iterator[_Probe]:
    """The probes in ``v``, itself or inside its lists, tuples and dict values (down to
    8 levels: deeper than any conversation)."""
    if isinstance(v, _Probe):
        yield v
    elif depth <= 8 and isinstance(v, (list, tuple)):
        for x in v:
            yield from _probes(x, depth + 1)
    elif depth <= 8 and isinstance(v, dict):
        for x in v.values():
            yield from _probes(x, depth + 1)


def _wrapped(f: Callable[..., Any], shape_only: bool = False) -> Callable[..., Any]:
    """``f`` (a filter or test) that spoils the recording of every probe among its
    arguments (``shape_only``: only a probe that is an argument itself, not one inside a
    list or dict) and gets the real contents in their place."""
    def call(*args: Any, **kwargs: Any) -> Any:
        values = (*args, *kwargs.values())
        probes = [v for v in values if isinstance(v, _Probe)] if shape_only else \
            [p for v in values for p in _probes(v)]
        if not probes:
            return f(*args, **kwargs)
        for p in probes:
            p.recording.spoiled = True
        return f(*_real(args), **_real(kwargs))
    # keep jinja's pass_context/pass_environment/pass_eval_context marker
    if hasattr(f, "jinja_pass_arg"):
        call.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]
    return call
