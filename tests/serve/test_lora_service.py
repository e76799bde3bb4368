"""LoRA behind the service (``lora`` section of ``ArcticRLClientConfig``): the in-process client trains adapters
(a real Lightning run, the transformers engine); ``export`` writes the merged weights, whose own forward gives the
service's log-probs; the base weights never change; ``save_state`` holds the adapters only and ``load_state``
restores them exactly, also under ZeRO-2 (a server process). The Tinker service takes a client's LoRA rank on a server whose model is not built yet,
and refuses another rank once it is, in the SDK's error shape."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.modules.lora import is_adapter
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from tests.serve.conftest import client_config
from tests.serve.test_core_requests import PROMPTS, G, own_forward_logprobs

pytestmark = pytest.mark.slow


def batch_of(client, seed):
    out = client.sample(PROMPTS, n=G, max_tokens=6, seed=seed)
    return TrainBatch.build([p for p in PROMPTS for _ in range(G)], out.flat_token_ids(), torch.linspace(-1.0, 1.0, len(PROMPTS) * G),
                            sampler_logprobs=out.flat_logprobs())


def test_local_client_trains_lora_adapters(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from arctic_rl.serve import targets

    config = client_config(tiny_model_dir, tmp_path, engines={"engine": "transformers"},
                           optim={"learning_rate": 0.01, "warmup_steps": 0}, lora={"rank": 4, "alpha": 8.0})
    with ArcticRLClient(config) as client:
        for seed in range(2):
            batch = batch_of(client, seed)
            client.forward_backward(batch, "dapo")
            client.optim_step()
            client.sync_weights()
        batch = batch_of(client, 5)
        logprobs = client.forward(batch, ["logprobs"])["logprobs"]
        client.export("merged")
        torch.testing.assert_close(own_forward_logprobs(tmp_path / "merged", batch), logprobs, rtol=1e-5, atol=1e-5)
        merged, base = load_file(tmp_path / "merged" / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
        assert merged.keys() == base.keys()
        for name, tensor in base.items():  # adapted layers moved; the rest is the base, bit for bit
            adapted = name.endswith("proj.weight")
            assert torch.equal(merged[name], tensor) != adapted, name

        client.save_state("states/a")
        state = torch.load(tmp_path / "states" / "a" / targets.STATE_FILE, map_location="cpu", weights_only=False)
        assert len(state["state_dict"]) == 28 and all(is_adapter(n) for n in state["state_dict"])
        client.forward_backward(batch_of(client, 7), "dapo")
        client.optim_step()
        assert not torch.equal(client.forward(batch, ["logprobs"])["logprobs"], logprobs)
        client.load_state("states/a")
        torch.testing.assert_close(client.forward(batch, ["logprobs"])["logprobs"], logprobs, rtol=0, atol=0)


def test_tinker_create_model_takes_the_clients_rank_then_refuses_another(tiny_model_dir, tmp_path):
    from arctic_rl.serve.config import ArcticRLClientConfig
    from arctic_rl.serve.core import ServiceCore
    from arctic_rl.serve.tinker.service import TinkerRefusal, TinkerService, error_body

    core = ServiceCore(ArcticRLClientConfig.load(client_config(tiny_model_dir, tmp_path, engines={"engine": "transformers"})))
    service = TinkerService(core)
    try:
        with pytest.raises(TinkerRefusal, match="lora_config.rank must be an integer >= 0"):
            service.create_model({"session_id": "s", "lora_config": {"rank": -2}})
        service.create_model({"session_id": "s", "lora_config": {"rank": 4, "train_unembed": True}})
        assert core.config.lora.rank == 4 and core.module.lora_options.rank == 4
        info = service.info({"model_id": service.model_id})
        assert info["is_lora"] is True and info["lora_rank"] == 4
        trainable = [n for n, p in core.module.model.named_parameters() if p.requires_grad]
        assert len(trainable) == 28 and all(is_adapter(n) for n in trainable)
        with pytest.raises(TinkerRefusal) as refused:
            service.create_model({"session_id": "t", "lora_config": {"rank": 8}})
        assert error_body(refused.value) == {"category": "user", "error": (
            "TinkerRefusal: LoRA rank 8 is not what this server trains: LoRA adapters of rank 4 (its lora.rank=4); "
            "create the training client with rank=4, or start a server with lora.rank: 8")}
    finally:
        core.close()


def test_tinker_lora_on_a_zero3_server_is_refused_before_the_model_is_built(tiny_model_dir, tmp_path):
    """``training.zero_stage: 3`` and a client's ``rank > 0``: the config's error (naming lora.rank and zero_stage) in
    the SDK's shape, the server's rank unchanged, nothing built."""
    from arctic_rl.serve.config import ArcticRLClientConfig
    from arctic_rl.serve.core import ServiceCore
    from arctic_rl.serve.tinker.service import TinkerRefusal, TinkerService

    core = ServiceCore(ArcticRLClientConfig.load(client_config(tiny_model_dir, tmp_path, training={"zero_stage": 3})))
    with pytest.raises(TinkerRefusal, match=r"LoRA rank 4: .*lora\.rank: 4 needs training\.zero_stage 0, 1 or 2, not 3"):
        TinkerService(core).check_lora({"rank": 4})
    assert core.config.lora.rank == 0 and not core.started


def test_lora_service_under_zero2_saves_the_adapters_only_and_loads_them_exactly(tiny_model_dir, tmp_path):
    """``training.zero_stage: 2`` (ArcticStrategy, gloo on CPU, in the server's own process): ``save_state`` writes a
    DeepSpeed checkpoint whose module state is the 28 adapters; ``load_state`` gives the saved log-probs back exactly."""
    from arctic_rl.serve import targets

    config = client_config(tiny_model_dir, tmp_path, protocol="http", engines={"engine": "transformers"},
                           training={"zero_stage": 2}, optim={"learning_rate": 0.01, "warmup_steps": 0}, lora={"rank": 4, "alpha": 8.0})
    with ArcticRLClient(config) as client:
        client.forward_backward(batch_of(client, 0), "dapo")
        client.optim_step()
        client.sync_weights()
        batch = batch_of(client, 5)
        logprobs = client.forward(batch, ["logprobs"])["logprobs"]
        client.save_state("states/z")
        saved = (tmp_path / "states" / "z" / targets.STATE_FILE).resolve() / "checkpoint" / "mp_rank_00_model_states.pt"
        module = torch.load(saved, map_location="cpu", weights_only=False)["module"]
        assert len(module) == 28 and all(is_adapter(n) for n in module), sorted(module)[:4]
        client.forward_backward(batch_of(client, 7), "dapo")
        client.optim_step()
        assert not torch.equal(client.forward(batch, ["logprobs"])["logprobs"], logprobs)
        client.load_state("states/z")
        torch.testing.assert_close(client.forward(batch, ["logprobs"])["logprobs"], logprobs, rtol=0, atol=0)
