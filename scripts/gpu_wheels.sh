#!/usr/bin/env bash
# Build the small wheels a GPU machine image lacks (torch, transformers and lightning present; no network there)
# into ./.whl, from the repo root on a machine with network. Copy .whl to the GPU machine and start with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD || exit
# The image already has torch 2.11 (cu130), transformers, lightning, triton, numpy, msgpack, ninja, psutil,
# py-cpuinfo, nvidia-ml-py, einops. Not carried: vllm (too large), wandb (use WANDB_MODE=disabled or CSV there).
# Ray (79 MB as published, over the 64 MiB a run may carry) is carried stripped to 40 MiB by scripts/strip_wheel.py:
# without its Java jars, the dashboard's web client, RLlib, Serve and ray.llm, none of which arctic-rl imports.
set -euo pipefail
exclude="$(git rev-parse --git-common-dir)/info/exclude"   # a worktree's .git is a file
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
opts=("${target[@]}" -d .whl)
python3 -m pip download "${opts[@]}" pydantic pydantic-core annotated-types typing-inspection hjson \
  jsonargparse docstring-parser typeshed-client datasets dill multiprocess liger-kernel prefix-grouper \
  "fastapi==0.136.3" "starlette==1.10.0" "uvicorn==0.54.0" trl accelerate pytest pluggy iniconfig pytest-timeout
python3 -m pip wheel --no-deps "deepspeed==0.19.8" -w .whl   # sdist -> pure-python wheel (ops JIT-build on the GPU)
# Ray and the dependencies of its core that the image lacks
python3 -m pip download "${opts[@]}" click jsonschema jsonschema-specifications referencing rpds-py attrs protobuf
ray_dir=$(mktemp -d)
python3 -m pip download "${target[@]}" -d "$ray_dir" "ray==2.60.0"
python3 "$(dirname "$0")/strip_wheel.py" "$ray_dir"/ray-*.whl .whl ray/jars/ ray/dashboard/client/ ray/rllib/ ray/serve/ ray/llm/
rm -rf "$ray_dir"
# benchmarks/rivals_gpu.py's rivals: AReaL's tree training (its import path reaches its engine and infrastructure
# packages, hence hydra/omegaconf/flask/openai/... that the image lacks; antlr4 4.9.3, hydra's pin, is an sdist) and
# unsloth's PrefixGrouper port (unsloth carried without its 27 MB studio/ web app and its CLI)
python3 -m pip download "${opts[@]}" "areal==1.0.4" colorlog tenacity flask blinker itsdangerous torchdata hydra-core \
  omegaconf openai jiter distro sniffio orjson lark "unsloth_zoo==2026.10.9"
python3 -m pip wheel --no-deps "antlr4-python3-runtime==4.9.3" -w .whl
unsloth_dir=$(mktemp -d)
python3 -m pip download "${target[@]}" -d "$unsloth_dir" "unsloth==2026.10.9"
python3 "$(dirname "$0")/strip_wheel.py" "$unsloth_dir"/unsloth-*.whl .whl studio/ unsloth_cli/
rm -rf "$unsloth_dir"
du -sh .whl
