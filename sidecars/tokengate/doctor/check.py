"""One check's outcome, as every check of ``tokengate doctor`` reports it, and the summary
line of a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["OK", "WARN", "FAIL", "SKIP"]


@dataclass(frozen=True)
class Check:
    """One check of one upstream (or of one part of the host: ``model`` is then
    ``unit``, ``counter``, ``ledger`` or ``redis``): ``status`` OK | WARN (passes, with a
    caveat) | FAIL | SKIP (not run: the upstream is unreachable, a user is unknown);
    ``detail``: what was seen, and for a failure what to change."""

    model: str
    upstream: str
    name: str
    status: Status
    detail: str

    def line(self) -> str:
        """``<STATUS> <model> <host:port> <check>: <detail>``"""
        return f"{self.status:<4} {self.model} {self.upstream} {self.name}: {self.detail}"


def summary(checks: list[Check]) -> str:
    """``N upstream(s): a OK, b warning(s), c failed, d skipped``"""
    n = len({(c.model, c.upstream) for c in checks})
    by = {s: sum(c.status == s for c in checks) for s in ("OK", "WARN", "FAIL", "SKIP")}
    return (f"{n} upstream(s): {by['OK']} OK, {by['WARN']} warning(s), {by['FAIL']} failed, "
            f"{by['SKIP']} skipped")
