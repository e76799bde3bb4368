"""The service on several training ranks (``training.devices: 2``, DeepSpeed ZeRO-2 over gloo on CPU, real rank
processes): a client loop on 2 ranks equals the same loop on 1 rank (losses, gradient norms, samples, weights
after 3 steps), over ``local`` and ``http`` (and ``ray``, on a real local Ray cluster), and equals ``Trainer.fit`` on 2 ranks replaying the batches the
client sent (losses, gradient norms, weights); save_state / load_state restore every shard; a bad request is refused
by every rank and changes nothing; close ends every rank process. The splitting and merging rules are unit-tested
first (``serve/ranks/split.py``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.ranks.split import merge_losses, merge_outputs, split_rows, take_rows
from tests.serve.conftest import client_config

STEPS, G = 3, 4
PROMPTS = [[5, 9, 11], [6, 12], [7, 13, 14, 15], [8, 16]]


# ---------------------------------------------------------------------------------------------- the rules
def test_whole_prompt_groups_go_to_one_rank_in_contiguous_blocks():
    prompts = [p for p in PROMPTS for _ in range(G)] + [[9, 9]] * 2  # 5 groups, the last of 2
    shares = split_rows(prompts, 2)
    assert shares == [list(range(12)), list(range(12, 18))]  # 3 groups, then 2
    assert split_rows(prompts, 5) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17]]


def test_fewer_groups_than_ranks_split_by_sequences_and_too_few_sequences_are_refused():
    assert split_rows([[1, 2]] * 5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(RequestError, match=r"the batch has 1 sequences, but the job's 2 training ranks \(training.devices x num_nodes\) each need at least one"):
        split_rows([[1, 2]], 2)


def test_shares_keep_their_rows_and_outputs_come_back_in_batch_order():
    batch = TrainBatch.build([[1], [1], [2]], [[3, 4], [5], [6, 7]], [0.5, -0.5, 1.0], sampler_logprobs=[[-1, -2], [-3], [-4, -5]])
    shares = [take_rows(batch, rows) for rows in split_rows(batch.prompt_token_ids, 2)]
    assert [s.prompt_token_ids for s in shares] == [[[1], [1]], [[2]]]
    assert all(s.response_ids.shape[1] == 2 for s in shares)  # widths line up for the merge
    merged = merge_outputs([{"x": s.sampler_logprobs} for s in shares])
    assert torch.equal(merged["x"], batch.sampler_logprobs)


def test_losses_sum_counts_stay_global_extremes_stay_extremes_and_means_are_weighted_by_sequences():
    replies = [{"loss": 0.25, "num_sequences": 6.0, "num_tokens": 40.0, "entropy": 1.0, "clip_ratio/low_min": 0.1,
                "clip_ratio/high_max": math.nan},
               {"loss": -0.5, "num_sequences": 2.0, "num_tokens": 40.0, "entropy": 3.0, "clip_ratio/low_min": 0.05,
                "clip_ratio/high_max": 0.2}]
    assert merge_losses(replies) == {"loss": -0.25, "num_sequences": 8.0, "num_tokens": 40.0, "entropy": 1.5,
                                     "clip_ratio/low_min": 0.05, "clip_ratio/high_max": 0.2}


# ---------------------------------------------------------------------------------------------- real ranks
def run_loop(client: ArcticRLClient, root, after_sync=None) -> dict:
    """3 GRPO-shaped steps (seeded samples, fixed advantages) then the exported weights; ``after_sync(step, samples)``
    runs after each step's ``sync_weights`` (``samples``: that step's ``sample`` answer)."""
    seen = []
    for step in range(STEPS):
        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=step)
        advantages = torch.linspace(-1.0, 1.0, len(PROMPTS) * G) * (1 if step % 2 else -1)
        batch = TrainBatch.build([p for p in PROMPTS for _ in range(G)], out.flat_token_ids(), advantages,
                                 sampler_logprobs=out.flat_logprobs())
        metrics = client.forward_backward(batch, "dapo")
        stepped = client.optim_step()
        client.sync_weights()
        if after_sync is not None:
            after_sync(step, out)
        sent = {"prompts": [p for p in PROMPTS for _ in range(G)], "completions": out.flat_token_ids(),
                "advantages": advantages, "sampler_logprobs": out.flat_logprobs()}
        seen.append({"samples": out.token_ids, "loss": metrics["loss"], "grad_norm": stepped["grad_norm"], "sent": sent,
                     "num_sequences": metrics["num_sequences"], "logprobs": client.forward(batch)["logprobs"]})
    client.export("final")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "final", dtype=torch.float32)
    return {"steps": seen, "weights": model.state_dict(), "batch": batch}


def assert_same_run(got: dict, want: dict) -> None:
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        assert g["samples"] == w["samples"], f"step {step}: different samples"
        assert g["num_sequences"] == w["num_sequences"] == len(PROMPTS) * G
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7), f"step {step} loss"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {step} grad norm"
        torch.testing.assert_close(g["logprobs"], w["logprobs"], rtol=1e-4, atol=1e-5)
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def config(model_dir, root, devices: int, **changes) -> dict:
    training = {"devices": devices, "zero_stage": 2 if devices > 1 else 0}
    return client_config(model_dir, root, training=training, engines={"engine": "transformers"}, **changes)


def assert_all_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("one_rank")
    with ArcticRLClient(config(tiny_model_dir, root, 1)) as client:
        return run_loop(client, root)


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    """The 2-rank service (``local``) after the 3-step loop: its client (still open), config, status and run."""
    root = tmp_path_factory.mktemp("two_ranks")
    cfg = config(tiny_model_dir, root, 2)
    with ArcticRLClient(cfg) as client:
        status = client.status()
        yield {"client": client, "config": cfg, "status": status, "run": run_loop(client, root)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_locally_equal_one_rank_then_save_load_refusals_and_shutdown(one_rank, two_ranks):
    client, status, got = two_ranks["client"], two_ranks["status"], two_ranks["run"]
    assert status["world_size"] == 2 and len(status["rank_pids"]) == 2
    assert_same_run(got, one_rank)

    # save_state writes every rank's ZeRO shard; a step later load_state puts all of them back
    batch, before = got["batch"], got["steps"][-1]["logprobs"]
    assert client.save_state("states/s3")["step"] == STEPS
    client.forward_backward(batch, "dapo")
    assert client.optim_step()["step"] == STEPS + 1
    assert not torch.allclose(client.forward(batch)["logprobs"], before)
    assert client.load_state("states/s3")["step"] == STEPS
    torch.testing.assert_close(client.forward(batch)["logprobs"], before, rtol=0, atol=1e-7)

    # refused by every rank (or by the front) before anything runs: weights, gradients and step as they were
    with pytest.raises(RequestError, match="outside the vocabulary|outside \\[0"):
        client.forward_backward(TrainBatch.build([[1]] * 2, [[99], [3]], [1.0, -1.0]), "dapo")
    with pytest.raises(RequestError, match="unknown loss"):
        client.forward_backward(batch, "no-such-loss")
    with pytest.raises(RequestError, match="each need at least one"):
        client.forward_backward(TrainBatch.build([[1]], [[3]], [1.0]), "dapo")
    with pytest.raises(RequestError, match="prompts\\[0\\]"):
        client.sample([[]], n=1)
    assert client.status()["step"] == STEPS
    torch.testing.assert_close(client.forward(batch)["logprobs"], before, rtol=0, atol=1e-7)
    client.close()  # the fixture's own close at teardown then does nothing
    assert_all_gone(status["rank_pids"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_equal_fit_on_two_ranks(two_ranks, tmp_path, monkeypatch):
    """The 2-rank service loop equals ``Trainer.fit`` on 2 ranks: ``GRPOModule`` in 2 real processes
    (``ArcticStrategy`` at the same ZeRO stage, gloo; ``tests/serve/rank_fit_worker.py``) with the option
    sections the service builds from the same client config, replaying the batches the client loop sent
    (prompts, sampled tokens and their log-probs, advantages) for its 3 steps. Losses, gradient norms and
    the exported weights agree to float tolerance.

    What differs, by design: the rollouts are the client's (fit's own engine, reward and advantage code are
    not part of the comparison; ``tests/serve/test_client_equivalence.py`` covers them on 1 rank, and the
    samples here already equal 1 rank's); fit deals prompt groups to the ranks interleaved (rank ``r``: groups
    ``r, r + 2, ...``), the service in contiguous blocks, so the ranks' shares differ and only the sums agree;
    the loss compared is the batch's (fit logs the ranks' shares summed, as the service's answer is)."""
    from tests.strategies.conftest import launch

    repo = str(Path(__file__).resolve().parents[2])  # the worker imports this checkout's arctic_rl and tests
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    got = two_ranks["run"]
    (tmp_path / "config.json").write_text(json.dumps(two_ranks["config"]))
    torch.save([step["sent"] for step in got["steps"]], tmp_path / "batches.pt")
    run = launch(tmp_path / "fit", 2, "--config", str(tmp_path / "config.json"), "--batches", str(tmp_path / "batches.pt"),
                 "--group-size", str(G), worker=Path(__file__).with_name("rank_fit_worker.py"))
    logs = "\n".join((run.out / f"log_rank{r}.txt").read_text()[-3000:] for r in range(2))
    assert run.returncodes == [0, 0], logs
    fit = run.metrics()
    assert [row["step"] for row in fit] == list(range(STEPS))
    for step, (g, w) in enumerate(zip(got["steps"], fit, strict=True)):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7), f"step {step} loss"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {step} grad norm"
    from transformers import AutoModelForCausalLM

    fit_weights = AutoModelForCausalLM.from_pretrained(run.out / "export", dtype=torch.float32).state_dict()
    assert fit_weights.keys() == got["weights"].keys()
    for name, tensor in fit_weights.items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module; its workers (and the rank processes the service actor starts)
    import this checkout's ``arctic_rl`` through PYTHONPATH. Shut down after the module."""
    ray = pytest.importorskip("ray")
    pythonpath = os.environ.get("PYTHONPATH")
    repo = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, pythonpath) if p)
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield ray
    ray.shutdown()
    if pythonpath is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = pythonpath


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("protocol", ["http", "ray"])
def test_two_ranks_behind_a_server_or_a_ray_actor_equal_one_rank(protocol, one_rank, tiny_model_dir, tmp_path, request):
    """The 2-rank core behind an embedded HTTP server, or inside the service actor on a real local Ray cluster
    (the module's, left running for other tests): the same loop equals 1 rank; close ends every rank process."""
    if protocol == "ray":
        request.getfixturevalue("ray_cluster")
    with ArcticRLClient(config(tiny_model_dir, tmp_path, 2, protocol=protocol)) as client:
        pids = client.status()["rank_pids"]
        assert len(pids) == 2
        got = run_loop(client, tmp_path)
    assert_same_run(got, one_rank)
    assert_all_gone(pids)
