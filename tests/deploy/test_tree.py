"""The tree's own rule on long files: a source or test file over 600 lines says in its
opening comment why it stays one file ("Over 600 lines: ..." or "Long for one
thing: ..."), so a long file is a decision, not an accident."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TREES = ("lua", "sidecars/tokengate", "storm", "dev", "client", "vllm_patches", "tests")
MOST_LINES = 600
REASONS = ("Over 600 lines", "Long for one thing")


def long_files() -> list[tuple[Path, list[str]]]:
    out = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.suffix not in (".py", ".lua") or "build" in path.parts:
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
            if len(lines) > MOST_LINES:
                out.append((path, lines))
    return out


def test_every_file_over_600_lines_says_why_in_its_opening_comment() -> None:
    files = long_files()
    assert files, "no long file found: the search is broken"
    silent = [f"{p.relative_to(ROOT)} ({len(lines)} lines)" for p, lines in files
              if not any(r in " ".join(lines[:40]) for r in REASONS)]
    assert silent == [], "long files without a reason:\n" + "\n".join(silent)
