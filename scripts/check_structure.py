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
Dunder names (``__init__``) are public. ``LIGHTNING_ADAPTER`` is the one module allowed Lightning's ``_`` internals.
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
    ("_version", "errors", "config_paths", "temp_dirs", "resume_policy", "causal_lm"),  # leaves: import nothing of ours
    ("zorro",),  # attention and log-prob kernels; no Lightning
    ("data",),  # prompt datasets and loaders
    ("weight_sync",),  # trainer -> engine parameter streams (engines seen through a one-method Protocol)
    ("callbacks",),  # the run's safety net (summary, checkpoints, preemption)
    ("console",),
    ("strategies",),  # ArcticStrategy, ZeRO helpers (models come in through the builder the module hands it)
    ("rollout",),  # engines, the rollout callback, rewards (the policy module seen through a Protocol)
    ("cluster",),  # Ray: engine actors and pools over rollout's engines
    ("modules",),  # the training core: GRPOModule and its pure functions
    ("serve",),  # the backend service over the core
    ("integrations", "recipes", "tasks"),  # adapters and user-level tasks over serve / modules
    ("plot", "preflight"),
    ("cli",),
    ("__init__",),  # the package's facade re-exports from anywhere
]

LIGHTNING_ADAPTER = "arctic_rl/strategies/lightning_adapter.py"

# Private names of other libraries that we cannot avoid, per module, each with its reason.
ALLOWED: dict[str, dict[str, str]] = {} and {
    "arctic_rl/strategies/arctic.py": {
        # ArcticStrategy subclasses Lightning's DeepSpeedStrategy; its overrides are Lightning's private hooks
        # and the state they work on (see the module's docstring for which upstream behaviour each lifts).
        "*": "a subclass of lightning's DeepSpeedStrategy overrides its private hooks",
    },
}


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``arctic_rl.<top>...``'s top-level name."""
    top = module.split(".")[1] if "." in module else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise KeyError(f"{module}: top-level name {top!r} is in no layer of LAYERS; add it")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1 and len(parts) == 2:
        return PACKAGE  # arctic_rl/__init__.py
    if parts[-1] == "__init__":
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


def private_uses(path: Path, tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, description)`` of each use of another module's private name in ``tree``."""
    own = defined_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
            if node.module and any(is_private(part) for part in node.module.split(".")) and node.module != f"{PACKAGE}._version":
                yield node.lineno, f"from {node.module} import ... (a private module)"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(is_private(part) for part in alias.name.split(".")):
                    yield node.lineno, f"import {alias.name} (a private module)"
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
            yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and is_private(node.args[1].value) and node.args[1].value not in own):
            yield node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"


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
            for line, what in private_uses(path, tree):
                if "*" not in allowed and what.rsplit(".", 1)[-1] not in allowed:
                    problems.append(f"{rel}:{line}: uses another module's private name: {what}")
        module = module_name(path)
        own_layer = layer_of(module)
        for line, target in imported_modules(tree, module, path.name == "__init__.py"):
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            if layer_of(target) > own_layer:
                problems.append(f"{rel}:{line}: upward import: {module} (layer {own_layer}) imports {target}"
                                f" (layer {layer_of(target)})")
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    print(f"check_structure: {len(problems)} violation{'s' * (len(problems) != 1)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
