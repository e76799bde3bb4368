"""tinker-cookbook's own RL loop (``tinker_cookbook.rl.train.main``, unmodified) against
``arctic-rl serve --api tinker``: the quickstart's echo task as a cookbook ``Env`` (token ids in, the echo
score out), groups of 4, 2 groups a step, 3 steps, ``importance_sampling``, on the tiny Qwen3 (CPU).

Checked: the loop finishes its steps and logs a reward for each; the reward changes from step to step; the
weights the loop saved at the end differ from the initial ones in most tensors.

Run with the layer (``scripts/integrations/tinker_cookbook.sh`` does):
``PYTHONPATH=.venv/site-tinker-cookbook:$PWD .venv/bin/python -m pytest integration_tests/tinker_cookbook``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
chz = pytest.importorskip("chz")
train = pytest.importorskip("tinker_cookbook.rl.train")
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult  # noqa: E402

from arctic_rl.serve.server import start_server_process  # noqa: E402
from arctic_rl.tasks.toy import echo_score  # noqa: E402

STEPS, GROUP_SIZE, GROUPS_PER_STEP = 3, 4, 2


class EchoEnv(Env):
    """One episode: the prompt's tokens, one completion, the echo score (plus a tie-breaker, so a random
    model's groups rarely tie and train nothing)."""

    def __init__(self, prompt: list[int], answer: str, tokenizer) -> None:
        self.prompt, self.answer, self.tokenizer = prompt, answer, tokenizer

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(self.prompt), [self.tokenizer.eos_token_id]

    async def step(self, action, *, extra=None):
        reward = echo_score(self.tokenizer.decode(action, skip_special_tokens=True), self.answer) + 0.01 * len(set(action))
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=[self.tokenizer.eos_token_id])


class EchoGroup(EnvGroupBuilder):
    def __init__(self, prompt: list[int], answer: str, tokenizer) -> None:
        self.prompt, self.answer, self.tokenizer = prompt, answer, tokenizer

    async def make_envs(self) -> Sequence[Env]:
        return [EchoEnv(self.prompt, self.answer, self.tokenizer) for _ in range(GROUP_SIZE)]


class EchoDataset(RLDataset):
    def __init__(self, groups: list[EchoGroup]) -> None:
        self.groups = groups

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.groups[index * GROUPS_PER_STEP:(index + 1) * GROUPS_PER_STEP]

    def __len__(self) -> int:
        return len(self.groups) // GROUPS_PER_STEP


@chz.chz
class EchoDatasetBuilder(RLDatasetBuilder):
    rows_path: str
    model_dir: str

    async def __call__(self):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        rows = [json.loads(line) for line in Path(self.rows_path).read_text().splitlines()]
        return EchoDataset([EchoGroup(tokenizer.encode(r["prompt"]), r["answer"], tokenizer) for r in rows]), None


@pytest.fixture(scope="module")
def cookbook_run(tmp_path_factory):
    """The server, then the cookbook's loop against it (its key in ``TINKER_API_KEY``, as the cookbook reads it)."""
    from arctic_rl.tasks.toy import write_task, write_tiny_model

    root = tmp_path_factory.mktemp("cookbook")
    model = write_tiny_model(root / "model", seed=0)
    task = write_task(root / "task", num_train=STEPS * GROUPS_PER_STEP, num_val=1)
    config = {"model": str(model), "training": {"accelerator": "cpu"},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 48},
              "server": {"root_dir": str(root / "root")}}
    token = f"tml-{secrets.token_urlsafe(16)}"
    server = start_server_process(config, api="tinker", token=token, startup_timeout_s=300)
    previous = os.environ.get("TINKER_API_KEY")
    os.environ["TINKER_API_KEY"] = token
    try:
        loop = train.Config(learning_rate=3e-3, model_name=str(model), recipe_name="arctic-rl-echo", max_tokens=6,
                            dataset_builder=EchoDatasetBuilder(rows_path=str(task / "train.jsonl"), model_dir=str(model)),
                            log_path=str(root / "log"), eval_every=0, save_every=0, lora_rank=0, base_url=server.url,
                            max_steps=STEPS, num_groups_to_log=0, rollout_json_export=False)
        asyncio.run(train.main(loop))
        yield {"root": root, "model": model, "log": root / "log", "server_log": server.output_tail()}
    finally:
        if previous is None:
            os.environ.pop("TINKER_API_KEY", None)
        else:
            os.environ["TINKER_API_KEY"] = previous
        server.stop()


def logged_steps(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_loop_runs_its_steps_and_the_reward_changes(cookbook_run):
    steps = [s for s in logged_steps(cookbook_run["log"]) if "env/all/reward/total" in s]
    assert len(steps) == STEPS, [sorted(s) for s in logged_steps(cookbook_run["log"])]
    rewards = [s["env/all/reward/total"] for s in steps]
    assert all(r == r for r in rewards) and len(set(rewards)) > 1, rewards


def test_the_saved_weights_changed(cookbook_run):
    from transformers import AutoModelForCausalLM

    saved = sorted((cookbook_run["root"] / "root" / "tinker").glob("*/sampler_weights/*"))
    assert saved, "the loop saved no sampler weights"
    before = dict(AutoModelForCausalLM.from_pretrained(cookbook_run["model"], dtype=torch.float32).named_parameters())
    after = dict(AutoModelForCausalLM.from_pretrained(saved[-1], dtype=torch.float32).named_parameters())
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) > len(before) // 2, changed
