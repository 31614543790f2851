"""TokenStorm through the real gateway: exact counts end to end and 429s split by the
limit that refused, with rejected and admitted tokens.

An extra edge instance (the edge tests' ``edge_variant_off_vllm``) routes the model to the fast
upstream and knows two keys: one whose RPM limit is small, one whose TPM limit is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokengate import config as tg_config
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.profiles import OutputPolicy
from tokenstorm.runner import RunSpec, execute

from tests.conftest import key_digest

RPM_KEY = "tg-test-storm-rpm"   # 10 requests per minute
TPM_KEY = "tg-test-storm-tpm"   # 1000 tokens per minute


def test_429s_are_split_by_limit_with_rejected_and_admitted_tokens(
        edge_variant_off_vllm: Any, counter_addr: str, fast_upstream_url: str,
        cfg: tg_config.Config) -> None:
    port = fast_upstream_url.split(":")[2].split("/")[0]

    def edit(raw: dict[str, Any]) -> None:
        for m in raw["models"].values():
            m["upstreams"] = [f"127.0.0.1:{port}"]
        raw["keys"]["storm-rpm"] = {"sha256": key_digest(RPM_KEY), "rpm": 10,
                                    "tpm": 1_000_000}
        raw["keys"]["storm-tpm"] = {"sha256": key_digest(TPM_KEY), "rpm": 1000, "tpm": 1000}

    edge = edge_variant_off_vllm("storm", edit)
    m = cfg.models["tiny-qwen3"]
    # 40 requests in one second, alternating keys: 20 each. Each reserves 200 prompt +
    # 16 output = 216 tokens, and settles at exactly that (the fast upstream generates
    # max_tokens), so the TPM key admits 4 (864 tokens; a 5th would be 1080 > 1000).
    spec = RunSpec(url=edge.base_url, model=m.name, model_dir=Path(m.dir),
                   max_model_len=m.max_model_len, arrival=ArrivalSpec("constant", rate=40.0),
                   duration_s=1.0, profile="normal:mean=200,sd=0",
                   output=OutputPolicy(fixed=16), keys=(RPM_KEY, TPM_KEY), max_lag_ms=1000.0,
                   name="gateway-429")
    with edge.window_clock():  # the 40 requests in one window no one has used
        s = execute(spec, progress=False).summary
        assert s.requests == 40
        assert s.status_counts == {"200": 14, "429": 26} and s.errors == {}
        assert s.keys == {"key0": {"requests": 20, "ok": 10, "429": 10},
                          "key1": {"requests": 20, "ok": 4, "429": 16}}
        lim = s.all.limits
        assert (lim.total, lim.requests, lim.tokens, lim.unknown) == (26, 10, 16, 0)
        assert lim.rejected_tokens == 26 * 216
        assert lim.rejected_tokens_by_requests_limit == 10 * 216
        assert lim.rejected_tokens_by_tokens_limit == 16 * 216
        assert lim.admitted_tokens == 14 * 216
        assert lim.retry_after_s is not None and lim.retry_after_s.n == 26
        # The gateway's exact count reached the upstream (usage) and the client (header).
        assert s.prompt_check["checked"] == 14 and s.prompt_check["mismatches"] == 0
        assert s.prompt_check["header_checked"] == 40
        assert s.prompt_check["header_mismatches"] == 0
        assert s.valid, s.invalid_reasons
