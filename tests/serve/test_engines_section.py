"""The client config's ``engines`` section reaches the service's engines (``build_engines``, an ``EngineHost``) field by
field: one in-process engine, or a Ray pool whose ``RayEngines`` carries the section's ``num_*`` knobs under the same
names, and the ``ray`` section's cluster address and placement strategy (the replicas are laid out as the ranks are)."""

from arctic_rl.rollout.callback import RayEngines
from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.core import build_engines


def test_one_engine_is_in_process_and_a_pool_takes_the_sections_resources():
    one = build_engines(ArcticRLClientConfig.load(model="m", engines={"engine": "transformers", "engine_kwargs": {"device": "cpu"}}))
    assert (one.host.kind, one.host.engine_kwargs, one.host.ray) == ("transformers", {"device": "cpu"}, None)
    config = ArcticRLClientConfig.load(model="m", engines={"engine": "vllm", "num_engines": 3, "num_gpus_per_engine": 0.5,
                                                          "num_cpus_per_engine": 2}, timeouts={"startup_s": 120})
    pool = build_engines(config)
    assert (pool.host.kind, pool.host.engine_kwargs) == ("vllm", {})
    assert pool.host.ray == RayEngines(num_engines=3, num_cpus_per_engine=2.0, num_gpus_per_engine=0.5, timeout_s=120.0)


def test_launcher_ray_makes_even_one_engine_a_replica_beside_several_ranks_on_the_ranks_cluster():
    config = ArcticRLClientConfig.load(model="m", training={"devices": 2, "zero_stage": 2}, engines={"engine": "vllm",
                                       "launcher": "ray"}, ray={"address": "10.0.0.1:6379", "placement_strategy": "SPREAD"})
    assert config.engines.on_ray
    host = build_engines(config).host
    assert host.ray == RayEngines(address="10.0.0.1:6379", num_engines=1, placement_strategy="SPREAD", timeout_s=900.0)
    assert build_engines(ArcticRLClientConfig.load(config, engines={"launcher": "in_process"}, ray={"address": None},
                                                   training={"devices": 1, "zero_stage": 0})).host.ray is None
