"""TokenStorm's fast upstream: an nginx + ngx_lua server that answers like vLLM 0.32.

It exists for capacity runs of the gateway: a Python server tops out at a few thousand
requests/s on this machine and would be the bottleneck; nginx with a small Lua content
handler (``vllm_like.lua``) answers tens of thousands per core. The protocol (bodies,
SSE framing, cumulative ``continuous_usage_stats`` usage, the final ``"choices": []``
usage chunk, error shapes) is checked against the real vLLM CPU server by
``tests/storm/test_upstream_contract.py``.

Prompt tokens in its usage come from the ``X-Token-Count`` request header (the
gateway sets it; TokenStorm sets it on direct runs with ``--send-token-count``); a
completions prompt of token ids is counted exactly; otherwise the count is an
estimate (``ceil(bytes / 4)`` plus ChatML overhead) and not vLLM's number.

Timing (``UpstreamOptions.ttft_ms``, ``itl_ms``): TTFT (ms) before the first token,
ITL (ms) between tokens; a non-streaming answer takes ``ttft + itl * (tokens - 1)``.

Engine metrics: ``GET /metrics`` serves vLLM's ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (what the edge's admission
reads) and ``vllm:request_success_total``; ``POST /tokenstorm/metrics`` with a JSON object
sets the gauges while it runs (``vllm_like.lua``, "Engine metrics").

Sleep mode: ``POST /sleep?level=N``, ``POST /wake_up`` and ``GET /is_sleeping`` as vLLM
serves them with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (``/sleep`` cuts
running streams short; a request that arrives while asleep is queued until a wake);
``wake_delay_ms`` (settable like the gauges) is how long a wake takes, and
``GET /tokenstorm/metrics`` reads the ``sleeps``, ``wakes`` and ``queued_asleep`` counts
(``vllm_like.lua``, "Sleep mode").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "nginx.conf.in"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


@dataclass(frozen=True)
class UpstreamOptions:
    """How the fast upstream behaves.

    ``model`` is the served model name (requests naming another model get vLLM's 404);
    ``max_model_len`` (tokens) drives vLLM's length checks and clamping; ``ttft_ms`` and
    ``itl_ms`` (milliseconds) are the simulated time to first token and inter-token
    latency; ``block_size`` (tokens) is the KV block used for ``created_cache_tokens``
    (vLLM's CPU backend uses 128); ``workers`` is nginx's worker_processes;
    ``vllm_version`` is what ``GET /version`` answers (``{"version": ...}``, as vLLM's
    ``vllm/entrypoints/serve/instrumentator/basic.py``); ``prompt_tokens_delta``
    (tokens) is added to the ``X-Token-Count`` it reports as ``usage.prompt_tokens``
    (never below 0): a stand-in for a vLLM that counts differently from the edge.
    """

    model: str = "tiny-qwen3"
    max_model_len: int = 8192
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    block_size: int = 128
    workers: int = 1
    root: str = ""
    vllm_version: str = "0.32.0"
    prompt_tokens_delta: int = 0

    def lua_options(self) -> dict[str, object]:
        """The JSON object passed to ``vllm_like.init`` at nginx start."""
        opts = asdict(self)
        opts.pop("workers")
        opts["root"] = self.root or self.model
        digest = hashlib.sha256(self.model.encode()).hexdigest()[:8]
        opts["fingerprint"] = f"vllm-{self.vllm_version}-{digest}"
        return opts


def render(opts: UpstreamOptions, prefix: Path, port: int, host: str = "127.0.0.1") -> Path:
    """Write ``prefix/nginx.conf`` for ``opts`` listening on host:port; returns its path.

    ``prefix`` receives the pid file, error log and nginx temp folders.
    """
    prefix.mkdir(parents=True, exist_ok=True)
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / sub).mkdir(exist_ok=True)
    # Workers of a root master run as nobody unless told otherwise; they must read the
    # Lua files and write the temp folders, so keep them as the invoking user.
    user = "user root;" if os.geteuid() == 0 else ""
    text = (TEMPLATE.read_text()
            .replace("@WORKERS@", str(opts.workers))
            .replace("@PREFIX@", str(prefix))
            .replace("@USER@", user)
            .replace("@LUA_DIR@", str(HERE))
            .replace("@OPTIONS_JSON@", json.dumps(opts.lua_options()))
            .replace("@HOST@", host)
            .replace("@PORT@", str(port)))
    conf = prefix / "nginx.conf"
    conf.write_text(text)
    return conf


def argv(conf: Path) -> list[str]:
    """The command line that runs nginx in the foreground on a rendered config."""
    return [NGINX, "-p", str(conf.parent), "-c", str(conf), "-e", str(conf.parent / "error.log")]
