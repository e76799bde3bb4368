"""The environment arctic-rl gives vLLM: defaults where unset, the user's values kept."""

from arctic_rl.rollout.vllm_env import VLLM_ENV_DEFAULTS, apply_vllm_env_defaults, vllm_env


def test_defaults_fill_only_what_is_unset():
    environ = {"VLLM_CPU_KVCACHE_SPACE": "8", "OTHER": "x"}
    apply_vllm_env_defaults(environ)
    assert environ == {**VLLM_ENV_DEFAULTS, "VLLM_CPU_KVCACHE_SPACE": "8", "OTHER": "x"}
    assert vllm_env({"VLLM_CONFIGURE_LOGGING": "1"}) == {**VLLM_ENV_DEFAULTS, "VLLM_CONFIGURE_LOGGING": "1"}
    assert VLLM_ENV_DEFAULTS["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core (tensors over RPC)


def test_engine_actors_always_run_the_engine_core_in_process():
    from arctic_rl.cluster.engine_actor import ENGINE_ENV

    assert ENGINE_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert set(VLLM_ENV_DEFAULTS) <= set(ENGINE_ENV)
