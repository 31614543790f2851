"""The ``engine_records`` check (``tokengate doctor`` only): the tokengate vLLM plugin is
loaded in an upstream's vLLM and writes where the ledger reads. The chat probe of
``tokengate.doctor.upstream`` goes with ``X-Request-Id: tokengate-doctor-<hex>``, and its
engine record (request_id ``chatcmpl-<that id>``) must be appended to one of
``ledger.engine_usage_files`` within ``engine_wait_s``. vLLM shows no sign of its
stat-logger plugins on any route or metric, so the record is the evidence; it also proves
the file is one the ledger reads. A replica on another host whose files are not here is a
warning (run the doctor there); a loopback one without its record fails.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokengate import config as tg_config
from tokengate.doctor import fetch
from tokengate.doctor.check import Check, Status

ENGINE_WAIT_S = 5.0  # how long a probe's engine record may take to appear, s


@dataclass(frozen=True)
class EngineMarks:
    """Where each engine usage file ended before the probe: (device, inode, size), or
    None for a file that was not there, or the ``str`` of why it could not be read."""

    at: dict[Path, tuple[int, int, int] | None | str]

    @classmethod
    def take(cls, files: list[Path]) -> EngineMarks:
        """The marks of ``files`` now, before the probe is sent."""
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


def check_records(check: Callable[[str, Status, str], Check], upstream: str,
                  files: list[Path], marks: EngineMarks, request_id: str, answered: bool,
                  wait_s: float) -> Check:
    """The ``engine_records`` check of ``upstream``: the record of ``request_id`` (the
    chat probe's, sent after ``marks`` were taken; ``answered``: it got a 200) appears in
    one of ``files`` (``ledger.engine_usage_files``) within ``wait_s`` seconds."""
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


def ledger_follows(listen: str, timeout_s: float) -> tuple[int, list[Path]]:
    """(status, files): the running ledger's answer to ``GET /status`` on ``listen``
    (``metrics.ledger_listen``) and the engine record files it follows (its
    ``engine_files``: the configured ones and those given on its command line,
    ``--engine-file``; [] unless the status is 200). Raises ``fetch.Unreachable``, and
    ``ValueError`` for an answer that is no JSON."""
    answer = fetch.request("GET", f"http://{listen}/status", timeout_s=timeout_s)
    if answer.status != 200:
        return answer.status, []
    return 200, [Path(p) for p in json.loads(answer.raw).get("engine_files") or []]


def followed_by_ledger(cfg: tg_config.Config, timeout_s: float = 5.0) -> list[Path]:
    """The engine record files the running ledger follows (``ledger_follows``; ``make
    run`` gives its ledger its embedded vLLM's file on the command line); [] when it
    cannot be asked or answers otherwise."""
    listen = cfg.metrics.ledger_listen
    if listen is None:
        return []
    try:
        return ledger_follows(listen, timeout_s)[1]
    except (fetch.Unreachable, ValueError, AttributeError):
        return []
