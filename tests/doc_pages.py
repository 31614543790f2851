"""The documentation's code blocks, for the tests that run what a page tells its reader:
a page under ``docs/`` is the one place its commands and configuration are written."""
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def code_block(page: str, lang: str, nth: int = 0) -> str:
    """The ``nth`` (0-based) fenced block of language ``lang`` in ``docs/<page>``, without its
    fences. Raises AssertionError naming the page when it has no such block."""
    text = (DOCS / page).read_text()
    blocks = re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert len(blocks) > nth, f"docs/{page} has no {lang} block number {nth + 1}"
    return blocks[nth]
