"""Fixtures of the embeddings tests: a pooling vLLM CPU server of the embedded model.

- ``pooling_vllm``: the session's vLLM server of ``var/models/tiny-qwen3`` with
  ``--runner pooling`` (an embedding model: ``POST /v1/embeddings`` only), served as
  ``EMBED_MODEL``; booted once by ``tests/fixtures_vllm.py``'s ``vllm_server`` factory
  (so every test that uses it is marked ``vllm``).
- ``add_embed_model(raw, upstream)``: a configuration edit (``tokengate.yaml`` as a dict)
  that adds ``EMBED_MODEL``, ``runner: pooling``, on ``upstream``.
- ``requests_to(server)``: the HTTP requests a vLLM server has answered on its OpenAI
  routes, to prove that nothing reached it.
"""

from __future__ import annotations

import copy
import urllib.request
from typing import Any

import pytest

from tests.conftest import MODEL
from tests.fixtures_edge import _HTTP_REQUESTS
from tests.fixtures_vllm import VllmFactory, VllmServer

# the served name of the pooling server, and its model's name in the tests' configuration
EMBED_MODEL = "tiny-qwen3-embed"
# vLLM's flags on top of devstack's: the pooling runner and the served name (argparse
# keeps the last --served-model-name: devstack's names the configured generating model)
# an embedding model's context (vLLM takes the last --max-model-len), as add_embed_model
# configures it
EMBED_MAX_MODEL_LEN = 8192
POOLING_ARGS = ("--runner", "pooling", "--served-model-name", EMBED_MODEL,
                "--max-model-len", str(EMBED_MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def pooling_vllm(vllm_server: VllmFactory) -> VllmServer:
    """The session's pooling vLLM server (devstack's flags plus ``POOLING_ARGS``), serving
    the embedded model as ``EMBED_MODEL``; its engine records go to
    ``TEST_DIR/vllm-pooling/engine.jsonl``."""
    return vllm_server(extra_args=POOLING_ARGS, label="pooling")


def add_embed_model(raw: dict[str, Any], upstream: str) -> None:
    """Adds ``EMBED_MODEL`` to the configuration ``raw`` (a parsed tokengate.yaml): the
    generating model's settings and directory, ``runner: pooling``, served by the vLLM
    at ``upstream`` (host:port, not the embedded one)."""
    m = copy.deepcopy(raw["models"][MODEL])
    # an embedding model's context, not the agents' 65,536 tokens of the generating
    # model: the limit tests send inputs just above it
    m.update(runner="pooling", upstreams=[upstream], embedded=False,
             max_model_len=EMBED_MAX_MODEL_LEN)
    raw["models"][EMBED_MODEL] = m


def requests_to(server: VllmServer) -> int:
    """HTTP requests ``server`` has answered on its OpenAI routes (/v1/...), from its
    /metrics (``http_requests_total``)."""
    with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(v) for h, _m, _s, v in _HTTP_REQUESTS.findall(text)
                   if h.startswith("/v1/")))
