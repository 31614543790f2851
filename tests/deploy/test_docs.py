"""The documentation as its readers meet it: the README is a front page whose first calls
work as written against a real edge (vLLM behind it), and ``docs/`` builds with MkDocs'
strict mode, so a broken link or anchor, or a page left out of the navigation, fails."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_edge import MAIN_KEY, Edge

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOC_URL = "http://127.0.0.1:8080"
DOC_KEY = "tg-demo-key"


def _readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)


def _mkdocs() -> Path:
    """MkDocs of the virtualenv ``make setup`` made for it (``.venv/.docs`` names it)."""
    pointer = ROOT / ".venv" / ".docs"
    assert pointer.exists(), "no .venv/.docs: run make setup (it installs MkDocs)"
    return Path(pointer.read_text().strip()) / "bin" / "mkdocs"


@pytest.mark.unit
def test_the_docs_build_strictly(tmp_path: Path) -> None:
    r = subprocess.run([str(_mkdocs()), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stderr
    assert (tmp_path / "site" / "operators" / "deploy.html").exists()


@pytest.mark.unit
def test_the_readme_is_a_front_page_whose_links_all_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert text.count("```sh\nmake run") == 1 and "make test" in text
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to no page"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert missing == []


@pytest.mark.unit
def test_every_page_under_docs_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if f": {p}" not in nav} == set()


def test_the_readme_first_calls_work_as_written(edge: Edge) -> None:
    base = edge.base_url.removesuffix("/v1")
    curl = _readme_blocks("sh")[1]
    assert DOC_URL in curl and DOC_KEY in curl
    r = subprocess.run(["bash", "-c", curl.replace(DOC_URL, base).replace(DOC_KEY, MAIN_KEY)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^HTTP/1.1 200", r.stdout, re.MULTILINE), r.stdout
    header = re.search(r"^X-Token-Count: (\d+)", r.stdout, re.MULTILINE | re.IGNORECASE)
    assert header, r.stdout
    prompt_tokens = int(header[1])
    assert f'"prompt_tokens":{prompt_tokens}' in r.stdout.replace(" ", "")

    openai_sdk, anthropic_sdk = _readme_blocks("python")
    printed = []
    for code in (openai_sdk, anthropic_sdk):
        assert DOC_URL in code and DOC_KEY in code
        r = subprocess.run([sys.executable, "-c",
                            code.replace(DOC_URL, base).replace(DOC_KEY, MAIN_KEY)],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        printed.append([int(n) for n in r.stdout.split()])
    assert all(n > 0 for numbers in printed for n in numbers), printed
    assert printed[0][0] == printed[0][1]   # usage.prompt_tokens == X-Token-Count
