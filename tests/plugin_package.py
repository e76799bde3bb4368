"""A plugin loss package installed in a test: ``write_plugin`` writes a distribution (modules and a dist-info with
entry points) under a folder, and ``installed_plugin`` installs ``arl_test_plugin_pg``, whose ``arctic_rl.losses``
entry point registers ``scaled_pg``, for ``fit``, the service and the TRL, verl and SkyRL adapters' tests."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

from arctic_rl import loss_registry

PACKAGE = "arl_test_plugin_pg"
# On-policy (old log-probs = the current ones, detached) the ratio is exactly 1, so the loss is
# -scale * sum(A * mask) / tokens and the reported ratio mean exactly 1.
PLUGIN = """
    import os

    import torch

    from arctic_rl.loss_registry import register_loss


    @register_loss("scaled_pg", needs=("entropy",), aggregation="token_mean")
    def scaled_pg(inputs, config):
        scale = float(config.get("scale", 1.0))
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        advantages = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages.unsqueeze(-1)
        loss = -scale * (ratio * advantages * inputs.mask).sum() / max(inputs.normalizer.num_tokens, 1.0)
        with open(os.environ["ARL_PLUGIN_MARKER"], "a") as marker:  # one line per micro-batch it computed
            marker.write(f"{inputs.entropy is not None}\\n")
        ratio_mean = (ratio.detach() * inputs.mask).sum() / inputs.mask.sum()
        return loss, {"plugin/ratio_mean": ratio_mean}
"""


def write_plugin(root: Path, package: str, entry_points: str, modules: dict[str, str]) -> None:
    """A distribution ``package`` installed under ``root``: its modules and a dist-info with entry points."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    for module, source in modules.items():
        (root / package / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    info.joinpath("entry_points.txt").write_text(textwrap.dedent(entry_points))


def installed_plugin(tmp_path: Path, monkeypatch, repo: Path) -> Iterator[Path]:
    """For a fixture: ``arl_test_plugin_pg`` installed under ``tmp_path/site``, on ``sys.path`` and ``PYTHONPATH``
    (subprocesses find it too, with ``repo`` after it); yields the marker file its loss appends a line to per
    micro-batch. The registry's table is restored and the plugin's modules forgotten afterwards."""
    loss_registry.get_loss("dapo")  # the built-ins are registered before the table is copied
    monkeypatch.setattr(loss_registry, "LOSSES", dict(loss_registry.LOSSES))
    monkeypatch.setattr(loss_registry, "LOADED_PLUGINS", set())
    site = tmp_path / "site"
    write_plugin(site, PACKAGE, f"[arctic_rl.losses]\nscaled_pg = {PACKAGE}.losses\n", {"losses": PLUGIN})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(repo), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ARL_PLUGIN_MARKER", str(tmp_path / "marker"))
    before = set(sys.modules)
    yield tmp_path / "marker"
    for name in set(sys.modules) - before:
        if name.startswith(PACKAGE):
            del sys.modules[name]
