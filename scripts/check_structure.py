"""Structure check over ``arctic_rl/``: no module uses another module's ``_private`` name, and no import runs up
the package's layers (``LAYERS`` below, as in ``docs/architecture.md``). Prints each violation with its file and
line and exits 1 if there is one; ``tests/test_structure.py`` runs it, so CI fails if one returns.

    python scripts/check_structure.py            # from the repository root

What counts as a private use, per module (a ``.py`` file):
- ``from m import _name`` where ``m`` is another module (ours or a third party's);
- an attribute ``x._name`` (read, write or call; ``getattr``/``setattr``/``hasattr`` with a literal name too)
  whose name this module does not define itself: a ``def``/``class``, an assignment ``_name = ...`` or
  ``<anything>._name = ...`` in this file. So ``self._helper()`` is fine where ``_helper`` is defined in the
  same file, and a subclass calling its base class's ``self._helper()`` from another file is not.
Dunder names (``__init__``) are public. ``LIGHTNING_ADAPTER`` is the one module allowed Lightning's ``_`` internals;
``ALLOWED`` lists the other libraries' private names we cannot avoid, each with its reason. Known blind spot: a
name this file defines for itself (say ``self._engine``) is not flagged on another object either (``pool._engine``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "arctic_rl"

# Lowest first. A module may import from its own layer's package and from any lower layer, never a higher one.
# docs/architecture.md section 2: the math (zorro) and the plumbing (data, weight sync, strategies) sit under
# the rollout; the training core (modules) drives the rollout and strategies; the service, integrations and
# CLI sit on top of the core.
LAYERS: list[tuple[str, ...]] = [
    ("_version", "errors", "config_paths", "temp_dirs", "ray_address"),  # the base: errors and small utilities
    # every option dataclass, and the loss registry's table whose names loss.loss_type chooses from: leaves (LEAF_MODULES)
    ("options", "loss_registry"),
    # leaves over the options: model building, the patches of other libraries (Lightning's internals, transformers'
    # modules), the kernels and checkpointing that the compute options switch
    ("causal_lm", "patches", "liger", "checkpointing", "router_replay"),
    ("zorro",),  # attention and log-prob kernels; no Lightning
    ("data",),  # prompt datasets and loaders
    ("weight_sync",),  # trainer -> engine parameter streams (engines seen through a one-method Protocol)
    ("callbacks",),  # the run's safety net (summary, checkpoints, preemption)
    ("console",),
    ("strategies",),  # ArcticStrategy, ZeRO helpers (transformers models built by the leaf causal_lm)
    ("rollout",),  # engines (local or Ray actors), the rollout callback, rewards; the module seen through a Protocol
    ("cluster",),  # Ray Train: training workers over the strategies
    ("modules",),  # the training core: GRPOModule and its pure functions
    ("resume_policy",),  # --ckpt_path against a changed config: compares the core's option sections
    ("serve",),  # the backend service over the core
    ("integrations", "recipes", "tasks"),  # adapters and user-level tasks over serve / modules
    ("plot", "preflight"),
    ("cli",),
    ("__init__",),  # the package's facade re-exports from anywhere
]

# Layers inside a package, lowest first, by the name that follows the package ("*": every other name). A module of
# the package may import from its own room and lower ones; the same rule as LAYERS, one level down.
ROOMS: dict[str, list[tuple[str, ...]]] = {
    # the engines wing sits under the rest of rollout (callback, multi-turn, rewards) and imports none of it
    "arctic_rl.rollout": [("engines",), ("*",)],
    # inside it: the boundary and the table of kinds, then each implementation, then the factory, then Ray actors, then
    # the host of a job's engines (in-process or a Ray pool)
    "arctic_rl.rollout.engines": [("base", "in_flight", "kinds", "seeds"), ("vllm", "transformers"), ("factory",), ("ray",), ("host",)],
    # the service: the core's modules (its operations, messages, config, the one-process core) under the transports;
    # the ranked core starts rank processes (or rank actors, each serving the Ray transport's actor) through the
    # transports; Tinker's API (and the OpenAI API) serves the (ranked) core and reuses the HTTP app's body reader; the server (the entry
    # point that picks an API) and the client sit on all of them; the asynchronous loop over the client on top
    "arctic_rl.serve": [("*",), ("transports",), ("ranks",), ("tinker", "openai"), ("server", "client"), ("async_loop",)],
}

LIGHTNING_ADAPTER = "arctic_rl/patches/lightning.py"
PATCHES = "arctic_rl/patches/"

# Modules (or packages: each module of it) that are leaves: each may import only the listed modules of ours and its
# own package's (lazy imports too), so everything above can import it. module or package -> (allowed imports, why)
LEAF_MODULES: dict[str, tuple[tuple[str, ...], str]] = {
    "arctic_rl.loss_registry": (("arctic_rl.errors",), "the one loss table: losses, the built-ins' module, the options "
                                "and the service import it; it imports the built-ins' module only by name, as a plugin's"),
    "arctic_rl.options": (("arctic_rl.errors", "arctic_rl.loss_registry"), "every option dataclass, plain data and its "
                          "checks: fit, the service and the rollout read them"),
}

# Private names of other libraries that we cannot avoid: module -> {name: why}. Nothing of ours is listed here.
ALLOWED: dict[str, dict[str, str]] = {
    "arctic_rl/integrations/trl.py": {
        # ArcticGRPOTrainer subclasses TRL's GRPOTrainer and reads the state TRL keeps only privately
        "_entropy_bonus_enabled": "TRL GRPOTrainer: whether the entropy bonus is on (no public flag)",
        "_tokenizer": "TRL GRPOTrainer: the processing class it tokenizes with",
        "_metrics": "TRL GRPOTrainer: the metric buffers its log() averages; we add ours to them",
    },
    "arctic_rl/integrations/verl_replica.py": {
        "_ROLLOUT_REGISTRY": "verl registers rollout backends only in this dict (no public register function)",
    },
    "arctic_rl/serve/server.py": {
        "_exit": "os._exit: the documented way to end a process at once, skipping atexit (stdlib)",
    },
    "arctic_rl/strategies/zero.py": {
        "_init_weights": "transformers PreTrainedModel: the per-module initialiser from_config runs, for ZeRO-3 buckets",
    },
    "arctic_rl/temp_dirs.py": {
        "_private": "wandb.sdk.data_types._private: where wandb keeps its media temp dir (cleaned up with the run)",
    },
    "arctic_rl/weight_sync/coordinator.py": {
        "_actor_id": "Ray ActorHandle: its id, to name the engine in an error (no public accessor on a handle)",
    },
    "arctic_rl/zorro/attention.py": {
        "_attn_implementation": "transformers PretrainedConfig: the attention function a model routes through",
    },
    "arctic_rl/zorro/cascade.py": {  # PyTorch's fused attention kernels, with the log-sum-exp a cascade needs
        "_flash_attention_forward": "torch.ops.aten: FlashAttention-2 varlen forward (returns the LSE)",
        "_flash_attention_backward": "torch.ops.aten: its backward",
        "_scaled_dot_product_cudnn_attention": "torch.ops.aten: cuDNN attention forward (returns the LSE)",
        "_scaled_dot_product_cudnn_attention_backward": "torch.ops.aten: its backward",
    },
    "arctic_rl/zorro/packed_mask.py": {  # a torch.Tensor subclass, written as PyTorch documents it
        "_C": "torch._C: home of _disabled_torch_function_impl",
        "_disabled_torch_function_impl": "torch: turns __torch_function__ off for the subclass",
        "_make_subclass": "torch.Tensor: wraps existing storage in the subclass",
    },
}


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``arctic_rl.<top>...``'s top-level name."""
    top = module.split(".")[1] if "." in module else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise KeyError(f"{module}: top-level name {top!r} is in no layer of LAYERS; add it")


def leaf_of(module: str) -> str:
    """The ``LEAF_MODULES`` entry ``module`` falls under: itself or its package (``module`` itself where none does)."""
    return next((leaf for leaf in LEAF_MODULES if module == leaf or module.startswith(leaf + ".")), module)


def room_of(package: str, module: str) -> int | None:
    """The index in ``ROOMS[package]`` of ``module``'s room (None: ``module`` is not inside ``package``)."""
    if not module.startswith(package + "."):
        return None
    name, rooms = module[len(package) + 1:].split(".")[0], ROOMS[package]
    for index, names in enumerate(rooms):
        if name in names:
            return index
    return next(index for index, names in enumerate(rooms) if "*" in names)


def module_name(relative: Path) -> str:
    """``arctic_rl/rollout/engines/base.py`` -> ``arctic_rl.rollout.engines.base``; a package's ``__init__.py`` -> the package."""
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """The private names this file defines: defs, classes, assigned names and assigned attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {name for name in names if is_private(name)}


def private_uses(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """``(line, name, description)`` of each use of another module's private name in ``tree``."""
    own = defined_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, alias.name, f"from {node.module} import {alias.name}"
            for part in (node.module or "").split("."):
                if is_private(part) and node.module != f"{PACKAGE}._version":
                    yield node.lineno, part, f"from {node.module} import ... (a private module)"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split("."):
                    if is_private(part):
                        yield node.lineno, part, f"import {alias.name} (a private module)"
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
            yield node.lineno, node.attr, f"{ast.unparse(node.value)}.{node.attr}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and is_private(node.args[1].value) and node.args[1].value not in own):
            yield node.lineno, node.args[1].value, f"{node.func.id}(..., {node.args[1].value!r})"


def patch_moves(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, description)`` of each run-time change to another object's code outside ``patches/``: assigning an
    attribute named ``forward``, ``types.MethodType``, reading a function's ``__globals__``, ``setattr`` on a
    module (a first argument named ``module``/``modeling`` or read from ``sys.modules``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "forward" and isinstance(node.ctx, ast.Store):
            yield node.lineno, f"assigns {ast.unparse(node)}"
        elif isinstance(node, ast.Attribute) and node.attr in ("MethodType", "__globals__"):
            yield node.lineno, f"uses {ast.unparse(node)}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args
              and any(word in ast.unparse(node.args[0]) for word in ("modul", "modeling"))):
            yield node.lineno, f"setattr on {ast.unparse(node.args[0])}"


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every ``arctic_rl`` module ``tree`` imports (at top level or inside a function)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.lineno, node.module


def check(root: Path = ROOT) -> list[str]:
    """Every violation under ``root/arctic_rl`` as ``path:line: message``; empty when the structure holds."""
    problems: list[str] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        allowed = ALLOWED.get(rel, {})
        if rel != LIGHTNING_ADAPTER:
            for line, name, what in private_uses(tree):
                if name not in allowed:
                    problems.append(f"{rel}:{line}: uses another module's private name: {what}")
        if not rel.startswith(PATCHES):
            for line, what in patch_moves(tree):
                problems.append(f"{rel}:{line}: patches another library outside {PATCHES}: {what}")
        module = module_name(path.relative_to(root))
        own_layer = layer_of(module)
        leaf_name = leaf_of(module)
        leaf = LEAF_MODULES.get(leaf_name)
        for line, target in imported_modules(tree, module, path.name == "__init__.py"):
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            if leaf is not None and target not in leaf[0] and not target.startswith(leaf_name + "."):
                problems.append(f"{rel}:{line}: {leaf_name} is a leaf ({leaf[1]}) and may import only "
                                f"{', '.join(leaf[0])}, not {target}")
            if layer_of(target) > own_layer:
                problems.append(f"{rel}:{line}: upward import: {module} (layer {own_layer}) imports {target}"
                                f" (layer {layer_of(target)})")
            for package in ROOMS:
                mine, theirs = room_of(package, module), room_of(package, target)
                if mine is not None and theirs is not None and theirs > mine:
                    problems.append(f"{rel}:{line}: upward import inside {package}: {module} (room {mine}) imports"
                                    f" {target} (room {theirs})")
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    print(f"check_structure: {len(problems)} violation{'s' * (len(problems) != 1)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
