"""GPU: the CUDA IPC transport (engine on the trainer's GPU) and the NCCL broadcast (engine on a second
GPU) between two real processes (no Ray on the GPU machine; the coordinator runs the same functions).

The trainer side is an ``IpcSender`` / ``send_buckets``; the engine side is a spawned process holding a
``TransformersEngine`` and loading what ``receive_ipc`` / ``receive_buckets`` yields. After every sync
the engine's per-tensor SHA-256 digests must equal the trainer's (bitwise copies). Buckets are small
so one sync spans many buckets (IPC: both buffers rotate and the embedding goes as an oversize tensor)."""

import hashlib
import tempfile

import pytest
import torch

pytestmark = pytest.mark.gpu

CONFIG = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=True)


def digests(named):
    return {name: hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest() for name, t in named}


def sync_items(model):
    return list(model.named_parameters()) + [("lm_head.weight", model.lm_head.weight)]


def engine_process(model_dir, address, device, syncs, results):
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
    from arctic_rl.weight_sync.broadcast import join_group, receive_buckets
    from arctic_rl.weight_sync.cuda_ipc import receive_ipc

    try:
        device = torch.device(device)
        torch.cuda.set_device(device)
        engine = TransformersEngine(model_dir, dtype="bfloat16", device=str(device))
        store, group = join_group(address, 1, device)
        for sync_id in range(1, syncs + 1):
            if address.backend == "cuda_ipc":
                engine.update_weights(receive_ipc(store, 1, sync_id, device))
            else:
                engine.update_weights(receive_buckets(group, sync_id, device, address.timeout_s))
            results.put(digests(engine.model.state_dict().items()))
    except BaseException as e:  # reported to the test instead of a silent hang
        results.put(repr(e))


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_engine_weights_equal_trainer_after_each_sync(backend):
    import torch.multiprocessing as mp

    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.toy import build_tokenizer
    from arctic_rl.weight_sync.broadcast import GroupAddress, free_port, join_group, send_buckets
    from arctic_rl.weight_sync.cuda_ipc import IpcSender

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("the NCCL transport test needs 2 GPUs")

    torch.manual_seed(0)
    model = build_causal_lm(CONFIG, "bfloat16")
    model_dir = tempfile.mkdtemp(prefix="arctic-rl-ipc-")
    model.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    model.to("cuda")
    address = GroupAddress("127.0.0.1", free_port(), 2, backend, 120.0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    engine_device = "cuda:0" if backend == "cuda_ipc" else "cuda:1"
    engine = ctx.Process(target=engine_process, args=(model_dir, address, engine_device, 3, results))
    engine.start()
    try:
        store, group = join_group(address, 0, torch.device("cuda", 0))
        sender = IpcSender(store, 1, torch.device("cuda", 0), bucket_bytes=300_000, timeout_s=120.0)
        embedding_bytes = CONFIG["vocab_size"] * CONFIG["hidden_size"] * 2
        assert embedding_bytes > 300_000  # goes alone, shared as itself
        for sync_id in range(1, 4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            if backend == "cuda_ipc":
                nbytes, count = sender.send(sync_id, iter(sync_items(model)))
            else:
                nbytes, count = send_buckets(group, sync_id, iter(sync_items(model)), 300_000, torch.device("cuda", 0), 120.0)
            got = results.get(timeout=120)
            assert not isinstance(got, str), got
            expected = digests(sync_items(model))
            assert count == len(expected) and nbytes == sum(t.numel() * 2 for _, t in sync_items(model))
            assert got.keys() >= expected.keys()
            assert {n: got[n] for n in expected} == expected, f"sync {sync_id}: engine differs from trainer"
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0
