#!/usr/bin/env bash
# tinker-cookbook integration stage: install tinker-cookbook 0.6.1 as a layer (.venv/site-tinker-cookbook) over
# the venv scripts/install.sh made (which has tinker 0.38.0, the `tinker` extra), then run
# integration_tests/tinker_cookbook: the cookbook's own RL loop (tinker_cookbook.rl.train.main) against
# `arctic-rl serve --api tinker`. Idempotent: a second run only runs the tests.
#
# A layer, not an extra: tinker-cookbook 0.6.1 requires tml-renderers>=0.4.1, which the package index this
# project installs from does not have (0.2.1 is the newest there). --no-deps with tml-renderers 0.2.1 works for
# the RL loop (it renders no chat template: the test's environment hands it token ids); blobfile needs lxml.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
LAYER="$(realpath -m "${TINKER_COOKBOOK_LAYER:-.venv/site-tinker-cookbook}")"
PACKAGES=(
  "tinker-cookbook==0.6.1" "chz==0.4.0" "blobfile==3.3.0" "pyrage==1.4.0" "termcolor==3.3.0" "lxml==6.1.3"
  "tml-renderers==0.2.1"
)
stamp="$LAYER/.arctic-rl-tinker-cookbook-layer"
start=$SECONDS
if [ "$(cat "$stamp" 2>/dev/null)" != "${PACKAGES[*]}" ]; then
  rm -rf "$LAYER"
  "$PYTHON" -m pip install -q --no-deps --target "$LAYER" "${PACKAGES[@]}"
  echo "${PACKAGES[*]}" > "$stamp"
fi
echo "tinker-cookbook layer ready in $((SECONDS - start)) s: $LAYER"
export PYTHONPATH="$LAYER:$PWD" HF_HUB_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
"$PYTHON" -c "
import importlib.metadata as m
print(' | '.join(f'{p} {m.version(p)}' for p in ('tinker-cookbook', 'tinker', 'tml-renderers', 'transformers', 'torch')))"
start=$SECONDS
# -n 0: one process, not pyproject's 2 xdist workers (a short stage; the framework's own code may start Ray)
"$PYTHON" -m pytest integration_tests/tinker_cookbook -q -n 0 -p no:cacheprovider --durations=5 "$@"
echo "tinker-cookbook integration tests: $((SECONDS - start)) s"
