"""``make bench`` and ``make bench-peers`` helpers: fresh prompts per run, the warm
paths' shapes, the floor's encoding, the peers' ratios, and the per-request headers
TokenStorm sends (Portkey's gateway takes its upstream from them)."""

from __future__ import annotations

import json

from tokengate import config as tg_config
from tokengate_dev.bench import paths, peers, stack
from tokenstorm.client import ClientConfig, Target, Worker
from tokenstorm.prompts import PromptBuilder, Sharing
from tokenstorm.runner import RunSpec, plan_for


def test_each_run_gets_prompts_of_its_own_unless_same_prompts_is_asked() -> None:
    fresh = stack.BenchOptions()
    seeds = [stack.prompt_seed(fresh) for _ in range(5)]
    assert len(set(seeds)) == 5 and 0 not in seeds
    same = stack.BenchOptions(same_prompts=True)
    assert [stack.prompt_seed(same) for _ in range(3)] == [0, 0, 0]


def test_a_next_turn_sends_nine_tenths_of_its_prompt_as_a_history_seen_before() -> None:
    assert paths.next_turn_sharing(1000) == Sharing(tenants=8, prefix_tokens=900,
                                                    conversations=1 << 20)


def test_the_floor_encodes_the_cold_prompts_both_ways_to_the_same_length(
        cfg: tg_config.Config) -> None:
    model = cfg.models["tiny-qwen3"]
    floor = paths.encode_floor_us(model, seed=7, opts=stack.BenchOptions(), idle_s=0.001)
    assert floor["prompts"] == paths.FLOOR_PROMPTS
    assert floor["prompt_tokens"] == 1000
    assert floor["encoder"] == "tiktoken"
    assert floor["encode_us"] == min(floor["encoder_us"], floor["hf_tokenizers_us"])
    for timed in ("encode_idle_us", "count_idle_us"):
        assert list(floor[timed]) == ["back to back", "after 1 ms idle"]
        assert all(us > 0 for us in floor[timed].values())


def test_paths_put_the_cold_gateway_cpu_over_encode_plus_plain_nginx() -> None:
    cpu = {"gateway no stream": {"edge nginx": 300.0, "counter": 500.0},
           "gateway no stream, next turn": {"edge nginx": 300.0, "counter": 200.0},
           "plain nginx no stream": {"plain nginx": 40.0}}
    fig: dict = {}
    floor = {"encode_us": 360.0}
    paths.paths_cpu(fig, cpu, floor, {"cold": True, "next turn": False})
    fig["floor"] = floor
    paths.cold_floor_ratio(fig)
    assert floor["total_us"] == 400.0
    assert fig["cold_cpu_floor_ratio"] == 2.0
    assert fig["cold_cpu_floor_source"] == "saturation"
    assert fig["paths"]["cold"] == {"edge_cpu_us": 300.0, "counter_cpu_us": 500.0,
                                    "gateway_cpu_us": 800.0, "saturation_valid": True}
    assert fig["paths"]["next turn"]["gateway_cpu_us"] == 500.0
    assert fig["paths"]["next turn"]["saturation_valid"] is False
    assert fig["paths"]["identical resend"] == {}


def test_peer_ratios_are_tokengate_over_each_peer() -> None:
    sides = {"direct": {"rps": 5000.0},
             "tokengate": {"rps": 1400.0, "cpu_us": 1200.0, "added_p50_ms": 1.5,
                           "added_p99_ms": 4.0},
             "Portkey": {"rps": 700.0, "cpu_us": 1600.0, "added_p50_ms": 3.0,
                         "added_p99_ms": 10.0},
             "LiteLLM": {"rps": 200.0, "cpu_us": None}}
    assert peers.ratios(sides) == {
        "rps_ratio_portkey": 2.0, "cpu_ratio_portkey": 0.75, "added_p50_ratio_portkey": 0.5,
        "added_p99_ratio_portkey": 0.4, "rps_ratio_litellm": 7.0}


def test_requests_carry_the_run_s_headers(cfg: tg_config.Config,
                                          prompt_builder: PromptBuilder) -> None:
    model = cfg.models["tiny-qwen3"]
    headers = (("x-portkey-provider", "openai"),
               ("x-portkey-custom-host", "http://127.0.0.1:9/v1"))
    spec = RunSpec(url="http://127.0.0.1:9/v1", model=model.name, model_dir=model.dir,
                   concurrency=1, max_requests=1, profile="normal:mean=100,sd=0",
                   headers=headers)
    worker = Worker(ClientConfig(Target.parse(spec.url), keys=("sk-x",), headers=headers),
                    prompt_builder, plan_for(spec, prompt_builder), [0])
    head, _, body = worker.request(0).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert "x-portkey-provider: openai" in lines
    assert "x-portkey-custom-host: http://127.0.0.1:9/v1" in lines
    assert "Authorization: Bearer sk-x" in lines
    assert json.loads(body)["model"] == model.name


def test_an_invalid_cold_saturation_run_takes_the_floor_ratio_from_the_fixed_rate() -> None:
    fig = {"floor": {"total_us": 400.0},
           "paths": {"cold": {"gateway_cpu_us": 500.0, "saturation_valid": False,
                              "valid": True, "rate_rps": 100.0,
                              "cpu_us_at_rate": {"edge nginx": 400.0, "counter": 600.0}}}}
    paths.cold_floor_ratio(fig)
    assert fig["cold_cpu_floor_ratio"] == 2.5
    assert fig["cold_cpu_floor_source"] == "100 req/s"
    fig = {"floor": {"total_us": 400.0},
           "paths": {"cold": {"gateway_cpu_us": 500.0, "saturation_valid": False,
                              "valid": False}}}
    paths.cold_floor_ratio(fig)
    assert "cold_cpu_floor_ratio" not in fig
