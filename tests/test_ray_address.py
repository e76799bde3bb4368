"""An unset ``ray.address`` starts a local cluster (or joins ``$RAY_ADDRESS``), never the one Ray last recorded."""

from arctic_rl.ray_address import init_address


def test_unset_address_is_ray_address_else_a_local_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert init_address(None) == "local"
    assert init_address("auto") == "auto" and init_address("10.0.0.1:6379") == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert init_address(None) == "10.0.0.2:6379"
    assert init_address("10.0.0.1:6379") == "10.0.0.1:6379"
