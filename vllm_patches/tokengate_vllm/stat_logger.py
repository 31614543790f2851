"""``EngineUsageLogger``: vLLM's stat-logger plugin point, writing engine usage records.

Registered as entry point ``vllm.stat_logger_plugins`` -> ``tokengate``; vLLM's
``AsyncLLM`` loads it in the API server process (vllm/v1/engine/async_llm.py,
``load_stat_logger_plugin_factories``), turns ``log_stats`` on for it (even with
``--disable-log-stats``), and ``StatLoggerManager`` builds one per engine (data
parallel rank) through ``PerEngineStatLoggerAdapter`` (vllm/v1/metrics/loggers.py).
After every batch of engine outputs, ``record()`` gets that batch's ``IterationStats``;
its ``finished_requests`` (``FinishedRequestStats``, vllm/v1/metrics/stats.py) become
one record each (``record.from_finished``), written in one append (``writer``).
Aborted requests, which get no ``FinishedRequestStats`` in vLLM 0.32, are written by
``hooks`` through the same writer.

Every logger of the process shares one writer per file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from tokengate_vllm import compat, hooks, record, settings
from tokengate_vllm.writer import RecordWriter

log = logging.getLogger("vllm.tokengate")

PART = "engine usage records"
_writers: dict[Path, RecordWriter] = {}


def _writer(path: Path) -> RecordWriter:
    w = _writers.get(path)
    if w is None:
        w = _writers[path] = RecordWriter(path)
    return w


def _served_model_name(vllm_config: Any) -> str | None:
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return None if name is None else str(name)


class EngineUsageLogger(StatLoggerBase):
    """Writes one engine usage record per finished request (see the module docstring).

    Inactive (``record()`` does nothing) on a vLLM version the plugin was not tested
    with (``compat.active``), with ``TOKENGATE_ENGINE_USAGE_FILE=off``, or when this
    vLLM lacks the frontend methods ``hooks`` wraps.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.writer: RecordWriter | None = None
        self.model = _served_model_name(vllm_config)
        if not compat.active(PART):
            return
        path = settings.usage_file()
        if path is None:
            log.info("%s: off (%s=off)", PART, settings.USAGE_FILE_ENV)
            return
        writer = _writer(path)
        try:
            hooks.install(writer.write, self.model)
        except AttributeError as e:
            # Without the abort hook some finished requests would have no record, and
            # a partial record stream bills worse than none (the ledger falls back to
            # the edge's numbers for a request without one).
            log.warning("%s: inactive, this vLLM's OutputProcessor differs from the one "
                        "the plugin wraps (%s)", PART, e)
            return
        self.writer = writer
        log.info("%s: engine %d writes to %s", PART, engine_index, path)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        """Write the records of the requests that finished in this batch, in one append."""
        if self.writer is None or iteration_stats is None:
            return
        finished = iteration_stats.finished_requests
        if not finished:
            return
        at = iteration_stats.iteration_timestamp
        self.writer.write([record.to_line(record.from_finished(f, at, self.model))
                           for f in finished])

    def log(self) -> None:
        """Called every ``VLLM_LOG_STATS_INTERVAL`` seconds by the API server (not with
        ``--disable-log-stats``; vllm/entrypoints/launchers/utils/server_utils.py): retries
        records a failed write left, so they need not wait for the next finished request."""
        if self.writer is not None and self.writer.pending():
            self.writer.write([])

    def log_engine_initialized(self) -> None:
        """Nothing to report at engine start."""
