"""Three wrappers on vLLM's frontend ``OutputProcessor`` (vllm/v1/engine/output_processor.py),
installed at runtime in the API server process; no vLLM file is changed.

Why they are needed (vLLM 0.32's source):

- ``abort_requests`` (called by ``AsyncLLM.abort`` when a client disconnects and
  ``generate()`` is cancelled, vllm/v1/engine/async_llm.py) pops the request's
  ``RequestState`` and never calls ``_update_stats_from_finished``: an aborted request
  produces **no** ``FinishedRequestStats``, so a stat logger alone never sees it.
  Its tokens still reached ``vllm:generation_tokens`` (counted per engine output while
  it ran), and outputs arriving after the abort are dropped before they are counted
  (``process_outputs``: ``req_state is None: continue``). The wrapper writes one
  ``source: "abort"`` record per dropped state, with the state's
  ``RequestStateStats`` at that moment: exactly what the counters saw.
- ``_update_stats_from_finished`` builds the ``FinishedRequestStats`` with
  ``request_id=req_state.external_req_id``, which every child of an ``n > 1`` request
  shares (``ParentRequest.get_child_info`` names children ``<index>_<parent internal
  id>``; the external id stays the parent's). The wrapper tags the stats it just made
  with ``tokengate_child = (request_index, n)`` so the records of the children differ,
  and with ``tokengate_edge`` (below).
- ``add_request`` (called by ``AsyncLLM.add_request`` in the task that serves the HTTP
  request, once per child of an ``n > 1`` request) makes the ``RequestState``; the
  wrapper tags it with ``tokengate_edge = (key id, endpoint)``, what the edge sent
  with the request (``edge.current()``), which goes into its record whether it
  finishes or is aborted.

Both wrappers call vLLM's method first and unchanged; a failure of tokengate's part is
logged and never reaches vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from tokengate_vllm import edge, record

log = logging.getLogger("vllm.tokengate")

Sink = Callable[[list[bytes]], object]

_MARK = "_tokengate_wrapped"
_sink: Sink | None = None
_model: str | None = None


def install(sink: Sink, model: str | None) -> None:
    """Wrap ``OutputProcessor`` (once per process) and send abort records, as lines, to
    ``sink``; ``model`` goes into them. Raises ``AttributeError`` when this vLLM has no
    such methods (the caller then stays inactive)."""
    global _sink, _model
    from vllm.v1.engine.output_processor import OutputProcessor

    _sink, _model = sink, model
    if getattr(OutputProcessor.abort_requests, _MARK, False):
        return
    abort_requests = OutputProcessor.abort_requests
    update_finished = OutputProcessor._update_stats_from_finished
    add_request = OutputProcessor.add_request

    def _add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        add_request(self, request, *args, **kwargs)
        try:
            sent = edge.current()
            state = self.request_states.get(request.request_id) if sent != (None, None) \
                else None
            if state is not None:
                state.tokengate_edge = sent
        except Exception:
            log.exception("tokengate: tagging a new request failed")

    def _abort_requests(self: Any, request_ids: Iterable[str], internal: bool) -> list[str]:
        # abort_requests calls itself for the children of a parent id: only the
        # outermost call records, after every state it dropped is gone.
        if getattr(self, "_tokengate_aborting", False):
            return abort_requests(self, request_ids, internal)  # type: ignore[no-any-return]
        before = dict(self.request_states)
        self._tokengate_aborting = True
        try:
            result = abort_requests(self, request_ids, internal)
        finally:
            self._tokengate_aborting = False
        try:
            gone = [s for rid, s in before.items() if rid not in self.request_states]
            if gone and _sink is not None:
                now = time.time()
                _sink([record.to_line(record.from_aborted(s, now, _model)) for s in gone])
        except Exception:
            log.exception("tokengate: recording aborted requests failed")
        return result  # type: ignore[no-any-return]

    def _update_stats_from_finished(self: Any, req_state: Any, finish_reason: Any,
                                    iteration_stats: Any) -> None:
        n_before = len(iteration_stats.finished_requests) if iteration_stats else 0
        update_finished(self, req_state, finish_reason, iteration_stats)
        try:
            if iteration_stats is not None and len(iteration_stats.finished_requests) > n_before:
                parent = req_state.parent_req
                fin = iteration_stats.finished_requests[-1]
                fin.tokengate_child = (req_state.request_index,
                                       parent.n if parent is not None else 1)
                fin.tokengate_edge = getattr(req_state, "tokengate_edge", (None, None))
        except Exception:
            log.exception("tokengate: tagging a finished request failed")

    setattr(_abort_requests, _MARK, True)
    OutputProcessor.abort_requests = _abort_requests
    OutputProcessor._update_stats_from_finished = _update_stats_from_finished
    OutputProcessor.add_request = _add_request
