"""The environment arctic-rl gives vLLM: defaults where unset, the user's values kept."""

from arctic_rl.rollout.engines.vllm.env import VLLM_ENV_DEFAULTS, apply_vllm_env_defaults, vllm_env


def test_defaults_fill_only_what_is_unset():
    environ = {"VLLM_CPU_KVCACHE_SPACE": "8", "OTHER": "x"}
    apply_vllm_env_defaults(environ)
    assert environ == {**VLLM_ENV_DEFAULTS, "VLLM_CPU_KVCACHE_SPACE": "8", "OTHER": "x"}
    assert vllm_env({"VLLM_CONFIGURE_LOGGING": "1"}) == {**VLLM_ENV_DEFAULTS, "VLLM_CONFIGURE_LOGGING": "1"}
    assert VLLM_ENV_DEFAULTS["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core (tensors over RPC)


def test_engine_actors_always_run_the_engine_core_in_process():
    from arctic_rl.rollout.engines.ray.actor import ENGINE_ENV

    assert ENGINE_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert set(VLLM_ENV_DEFAULTS) <= set(ENGINE_ENV)


def test_cpu_kv_cache_is_sized_to_the_run(tmp_path):
    import json

    from arctic_rl.rollout.engines.vllm.engine import cpu_kv_cache_bytes

    def config_dir(name, **fields):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", **fields}))
        return str(directory)

    mid = config_dir("mid", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256)
    per_token = 2 * 4 * 2 * 64 * 4  # k and v, layers, kv heads, head_dim, fp32 bytes
    assert cpu_kv_cache_bytes(mid, "float32", max_model_len=300, max_num_seqs=64) == 2 * per_token * 384 * 64  # 3 blocks of 128
    assert cpu_kv_cache_bytes(mid, "float32", max_model_len=40, max_num_seqs=2) == 64 << 20  # floor
    big = config_dir("big", num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=2048)
    assert cpu_kv_cache_bytes(big, "bfloat16", max_model_len=2048, max_num_seqs=256) == 1 << 30  # cap: the old fixed size
