#!/usr/bin/env bash
# vLLM 0.34.0's Python source (the GPU wheel from PyPI, compiled kernels left out) in
# .cache/vllm-0.34.0, for tests/compat: the guard on 0.34's scheduler and Model Runner V2
# connector driver. Nothing is installed into .venv. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/vllm-0.34.0
[ -f "$dest/.done" ] && exit 0
echo "== fetching vLLM 0.34.0's Python source (one 240 MB wheel, no dependencies) for tests/compat"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip --disable-pip-version-check download -q --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$tmp" vllm==0.34.0
rm -rf "$dest"
.venv/bin/python - "$tmp" "$dest" <<'PY'
import glob, sys, zipfile
wheel, dest = glob.glob(f"{sys.argv[1]}/vllm-0.34.0-*.whl")[0], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PY
touch "$dest/.done"
