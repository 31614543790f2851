"""``pip install ./client`` as an application's developer runs it: a fresh virtualenv of
the machine's Python, the distribution ``tokengate-client`` with what pip resolves for
it, and docs/api/client-sdk.md's example run from there against a real edge (the fast upstream
behind it)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MODEL
from tests.deploy.test_install import fresh_venv
from tests.doc_pages import code_block
from tests.fixtures_edge import MAIN_KEY, Edge

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# what the services need and an application must not get with the SDK
HEAVY = {"grpcio", "redis", "jinja2", "tokengate", "transformers", "tokenizers", "torch"}


def doc_example() -> str:
    """The Python block of docs/api/client-sdk.md."""
    return code_block("api/client-sdk.md", "python")


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """python of a fresh virtualenv with only ``pip install ./client``."""
    return fresh_venv(tmp_path_factory.mktemp("client") / "venv", ROOT / "client",
                      timeout_s=600)


def test_the_sdk_alone_pulls_none_of_the_services_dependencies(client_venv: Path) -> None:
    out = subprocess.run([str(client_venv), "-m", "pip", "list", "--format", "freeze"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    installed = {line.split("==")[0].lower().replace("_", "-") for line in out.split()}
    assert "tokengate-client" in installed and "openai" in installed
    assert installed & HEAVY == set()


def test_the_doc_example_runs_from_the_sdk_alone(
        client_venv: Path, edge_variant_off_vllm: Callable[..., Edge],
        fast_upstream_url: str) -> None:
    def upstream(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [
            fast_upstream_url.removeprefix("http://").removesuffix("/v1")]
        raw["models"][MODEL]["embedded"] = False

    edge = edge_variant_off_vllm("client-package", upstream)
    example = doc_example()
    assert 'base_url="http://127.0.0.1:8080/v1", api_key="tg-demo-key"' in example
    script = example.replace("http://127.0.0.1:8080/v1", edge.base_url) \
                    .replace("tg-demo-key", MAIN_KEY)
    script += "\nprint('\\nBILLED', answer.usage.total_tokens, answer.token_count)\n"
    r = subprocess.run([str(client_venv), "-c", script], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    billed = r.stdout.rsplit("BILLED", 1)[1].split()
    assert int(billed[0]) > 64 and int(billed[1]) > 0   # prompt + 64 generated; the count
    assert "completion_tokens=512" in r.stdout           # the stream's usage, billed


def test_offline_counting_without_the_tokengate_package_says_what_to_install(
        client_venv: Path) -> None:
    script = ("from tokengate_client import Client\n"
              "Client(base_url='http://127.0.0.1:9/v1', api_key='k', config='tokengate.yaml')")
    r = subprocess.run([str(client_venv), "-c", script],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1
    assert "ImportError: counting prompts offline (config=...) needs the tokengate " \
           "package, the counter's own library: pip install ./sidecars" in r.stderr
