# tokengate: the verbs a user types.
#   make run    install what is missing, start the whole stack on loopback
#   make test   install what is missing, run the whole test suite against real processes
#   make test-fast  every test that needs no vLLM server (edge, counter, ledger, limits,
#                   storm against fakes and the fast upstream); no vLLM is started
#   make test-unit  the tests that start no process of the stack (minutes: tokenizer checks)
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup run test test-fast test-unit docs bench-counter bench bench-peers bench-scheduler bench-routing bench-slo bench-fairness bench-batch \
	soak lint model clean

setup:
	@bash scripts/setup.sh

# CONFIG=path: another tokengate.yaml (e.g. in front of vLLM servers of your own);
# COUNTER_PORT=N: the counter's gRPC port (default 50051)
run: setup
	@$(PY) -m tokengate_dev.devstack run $(if $(CONFIG),--config $(CONFIG)) \
		$(if $(COUNTER_PORT),--counter-port $(COUNTER_PORT))

# pytest-xdist workers of make test: each has ports and a folder of its own; the tests of a
# module, and those of a vLLM server, are one group that one worker runs, and the workers
# take the groups longest first (tests/conftest.py orders them; --no-loadscope-reorder
# keeps that order); TEST_WORKERS=0 runs in one process.
# Three on two cores: many tests wait on a process (a start, a reload, a window), and a
# third worker fills those waits (a clean clone: 673 s with two, 547 s with three)
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The suite's ~500 Python processes (sidecars, command lines, replicas) and its workers
# read tokengate's modules and the rewritten tests from __pycache__: with bytecode not
# written (PYTHONDONTWRITEBYTECODE set in the environment) each start compiled them again,
# ~0.2 CPU-s a process and 6 s of each worker's collection
test test-fast test-unit: export PYTHONDONTWRITEBYTECODE :=

test: setup
	@$(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	@$(PY) -m pytest tests -m "not vllm" $(XDIST) $(PYTEST_ARGS)

test-unit: setup
	@$(PY) -m pytest tests -m unit $(PYTEST_ARGS)

# docs/ as a site (MkDocs, strict: a broken link fails) in var/site; open var/site/index.html
docs: setup
	@"$$(cat .venv/.docs)/bin/mkdocs" build --strict

bench-counter: setup
	@$(PY) -m tokengate_dev.bench.counter

# TokenStorm: ceilings (vs vllm bench serve) and direct vs through the gateway, on the
# fast upstream; results in bench/results/. BENCH_ARGS: see
# `python -m tokengate_dev.bench.storm --help`.
bench: setup
	@$(PY) -m tokengate_dev.bench.storm $(BENCH_ARGS)

# vLLM's FCFS order against the plugin's token-weighted scheduler: the vLLM CPU server
# started twice, the same TokenStorm workload each time; results in bench/results/.
# BENCH_ARGS: see `python -m tokengate_dev.bench.scheduler --help`.
bench-scheduler: setup
	@$(PY) -m tokengate_dev.bench.scheduler $(BENCH_ARGS)

# tokengate beside LiteLLM's proxy and Portkey's gateway (each installed on demand under
# ~/.cache/tokengate/peers) on one fast upstream, the same prompts; ratios and aims.
# BENCH_ARGS: see `python -m tokengate_dev.bench.peers --help`.
bench-peers: setup
	@$(PY) -m tokengate_dev.bench.peers $(BENCH_ARGS)

# The edge's replica choice: round robin, least outstanding, prefix (approximate and
# precise) through the gateway, the same TokenStorm workloads (shared prefixes, none) on
# simulated GPU replicas; BENCH_ARGS=--vllm adds two vLLM CPU replicas. Results in
# bench/results/. BENCH_ARGS: see `python -m tokengate_dev.bench.routing --help`.
bench-routing: setup
	@$(PY) -m tokengate_dev.bench.routing $(BENCH_ARGS)

# Serving to latency targets: goodput, TTFT and TPOT per class and policy on simulated
# H100 replicas (vLLM's scheduler, roofline-timed steps) through the gateway, 0.6x-1.4x
# of the fleet's capacity; the roofline against published vLLM numbers; aims met / not
# met. BENCH_ARGS: see `python -m tokengate_dev.bench.slo --help` (--roofline-only).
bench-slo: setup
	@$(PY) -m tokengate_dev.bench.slo $(BENCH_ARGS)

bench-fairness: setup
	@$(PY) -m tokengate_dev.bench.fairness $(BENCH_ARGS)

# The Batch API on spare capacity: steady interactive traffic on simulated replicas,
# alone and beside a 2,000-line batch; TTFT p99, the fleet's busy share, the batch's
# completion time, each aim met / not met. BENCH_ARGS: see
# `python -m tokengate_dev.bench.batch --help`.
bench-batch: setup
	@$(PY) -m tokengate_dev.bench.batch $(BENCH_ARGS)

# The chaos soak: the whole stack, every feature on, under TokenStorm load on simulated
# replicas while parts are killed, stalled and reloaded at random; then its invariants,
# each with its figures; exit 0 only when all held. SOAK_S: seconds of load (default
# 900); SOAK_SEED: the load's and the faults' seed (default 0). Results in bench/results/.
# BENCH_ARGS: see `python -m tokengate_dev.bench.soak --help`.
soak: setup
	@$(PY) -m tokengate_dev.bench.soak $(if $(SOAK_S),--duration $(SOAK_S)) \
		$(if $(SOAK_SEED),--seed $(SOAK_SEED)) $(BENCH_ARGS)

lint: setup
	@$(PY) -m ruff check sidecars client storm dev vllm_patches tests
	@cd sidecars && ../$(PY) -m mypy tokengate
	@cd client && ../$(PY) -m mypy tokengate_client
	@cd storm && ../$(PY) -m mypy tokenstorm
	@cd dev && ../$(PY) -m mypy tokengate_dev
	@cd vllm_patches && ../$(PY) -m mypy tokengate_vllm

clean:
	rm -rf var/run var/log
