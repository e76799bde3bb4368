"""scripts/check_structure.py: the package has no cross-module ``_private`` use and no upward import, and the
check itself finds each kind of violation."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import check_structure  # noqa: E402


def test_package_structure_holds():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_structure.py")], capture_output=True, text=True, cwd=ROOT)
    assert run.stdout.splitlines()[-1] == "check_structure: 0 violations", run.stdout
    assert run.returncode == 0


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(("files", "expected"), [
    ({"arctic_rl/rollout/a.py": "from arctic_rl.modules.b import f\n"},
     ["arctic_rl/rollout/a.py:1: upward import: arctic_rl.rollout.a (layer 9) imports arctic_rl.modules.b (layer 11)"]),
    ({"arctic_rl/weight_sync/a.py": "def f():\n    import arctic_rl.rollout.engines.base\n"},  # a lazy import counts too
     ["arctic_rl/weight_sync/a.py:2: upward import: arctic_rl.weight_sync.a (layer 5) imports arctic_rl.rollout.engines.base (layer 9)"]),
    ({"arctic_rl/serve/a.py": "from arctic_rl.modules.b import _helper\n"},
     ["arctic_rl/serve/a.py:1: uses another module's private name: from arctic_rl.modules.b import _helper"]),
    ({"arctic_rl/serve/a.py": "class S(Base):\n    def f(self):\n        return self._micro_batch_loss()\n"},
     ["arctic_rl/serve/a.py:3: uses another module's private name: self._micro_batch_loss"]),
    ({"arctic_rl/serve/a.py": "def f(trainer):\n    return getattr(trainer, '_checkpoint_connector')\n"},
     ["arctic_rl/serve/a.py:2: uses another module's private name: getattr(..., '_checkpoint_connector')"]),
    ({"arctic_rl/serve/a.py": "class S:\n    def __init__(self):\n        self._n = 0\n\n    def f(self, other):\n"
                              "        return self._n + other._n + len(self.__dict__)\n"},  # its own names, dunders
     []),
    ({"arctic_rl/modules/a.py": "from arctic_rl.rollout.b import f\nfrom arctic_rl.zorro import g\n"}, []),  # downward
    ({"arctic_rl/rollout/engines/vllm/a.py": "from arctic_rl.rollout.callback import f\n"},  # the engines wing is a room
     ["arctic_rl/rollout/engines/vllm/a.py:1: upward import inside arctic_rl.rollout: arctic_rl.rollout.engines.vllm.a"
      " (room 0) imports arctic_rl.rollout.callback (room 1)"]),
    ({"arctic_rl/rollout/engines/base.py": "from arctic_rl.rollout.engines.vllm.engine import E\n"},  # base under engines
     ["arctic_rl/rollout/engines/base.py:1: upward import inside arctic_rl.rollout.engines: arctic_rl.rollout.engines.base"
      " (room 0) imports arctic_rl.rollout.engines.vllm.engine (room 1)"]),
    ({"arctic_rl/rollout/callback.py": "from arctic_rl.rollout.engines.factory import f\n"}, []),
    ({"arctic_rl/serve/ops.py": "def f():\n    from arctic_rl.serve.ranks.ranked import make_core\n"},  # serve's rooms
     ["arctic_rl/serve/ops.py:2: upward import inside arctic_rl.serve: arctic_rl.serve.ops (room 0) imports"
      " arctic_rl.serve.ranks.ranked (room 2)"]),
    ({"arctic_rl/serve/transports/http_app.py": "from arctic_rl.serve.tinker.app import f\n"},  # transports under tinker
     ["arctic_rl/serve/transports/http_app.py:1: upward import inside arctic_rl.serve: arctic_rl.serve.transports.http_app"
      " (room 1) imports arctic_rl.serve.tinker.app (room 3)"]),
    ({"arctic_rl/serve/ranks/ranked.py": "from arctic_rl.serve.server import serve\n"},  # the entry point on top
     ["arctic_rl/serve/ranks/ranked.py:1: upward import inside arctic_rl.serve: arctic_rl.serve.ranks.ranked (room 2)"
      " imports arctic_rl.serve.server (room 4)"]),
    ({"arctic_rl/serve/tinker/service.py": "from arctic_rl.serve.ranks.ranked import RankedCore\n"
                                           "from arctic_rl.serve.core import C\n",
      "arctic_rl/serve/server.py": "from arctic_rl.serve.tinker.app import f\nfrom arctic_rl.serve.transports.process import g\n"},
     []),
    ({"arctic_rl/loss_registry.py": "from arctic_rl.errors import ConfigError\nfrom arctic_rl.options import LossConfig\n"},
     ["arctic_rl/loss_registry.py:2: arctic_rl.loss_registry is a leaf (the one loss table: losses, the built-ins' module, "
      "the options and the service import it; it imports the built-ins' module only by name, as a plugin's) and may "
      "import only arctic_rl.errors, not arctic_rl.options"]),
    ({"arctic_rl/options/rollout.py": "from arctic_rl.options.sections import S\nfrom arctic_rl.loss_registry import f\n"
                                      "from arctic_rl.errors import ConfigError\n\ndef g():\n    from arctic_rl.checkpointing import h\n"},
     ["arctic_rl/options/rollout.py:6: arctic_rl.options is a leaf (every option dataclass, plain data and its checks: fit, "
      "the service and the rollout read them) and may import only arctic_rl.errors, arctic_rl.loss_registry, not "
      "arctic_rl.checkpointing",
      "arctic_rl/options/rollout.py:6: upward import: arctic_rl.options.rollout (layer 1) imports arctic_rl.checkpointing (layer 2)"]),
])
def test_check_finds_each_violation(tmp_path, files, expected):
    assert check_structure.check(write(tmp_path, files)) == expected


@pytest.mark.parametrize(("code", "what"), [
    ("def f(m, g):\n    m.forward = g\n", "assigns m.forward"),
    ("import types\n\ndef f(m, g):\n    return types.MethodType(g, m)\n", "uses types.MethodType"),
    ("def f(fn):\n    return fn.__globals__\n", "uses fn.__globals__"),
    ("def f(modeling, g):\n    setattr(modeling, 'fn', g)\n", "setattr on modeling"),
])
def test_only_patches_may_change_other_libraries_objects(tmp_path, code, what):
    root = write(tmp_path, {"arctic_rl/patches/transformers.py": code, "arctic_rl/zorro/a.py": code})
    [problem] = check_structure.check(root)
    assert problem.startswith("arctic_rl/zorro/a.py:") and problem.endswith(f"patches another library outside arctic_rl/patches/: {what}")


def test_only_patches_lightning_may_use_lightning_internals(tmp_path):
    code = "def f(trainer):\n    return trainer._checkpoint_connector\n"
    root = write(tmp_path, {"arctic_rl/patches/lightning.py": code, "arctic_rl/serve/a.py": code})
    assert check_structure.check(root) == ["arctic_rl/serve/a.py:2: uses another module's private name: trainer._checkpoint_connector"]
