"""How a service names and builds its handler: a ``package.module:function`` path called with the config dict."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

DEFAULT_FACTORY = "arctic_rl.serve.ranks.ranked:build_handler"


def load_factory(path: str) -> Callable[[dict[str, Any]], Any]:
    """The function ``path`` names (``"package.module:function"``), imported on demand."""
    module_name, sep, name = path.partition(":")
    if not (sep and module_name and name):
        raise ValueError(f"a handler factory is written 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import the handler factory {path!r}: {e}") from e
    factory = vars(module).get(name)
    if not callable(factory):
        raise ValueError(f"the handler factory {path!r}: module {module_name!r} has no function {name!r}")
    return factory


def build_handler(path: str, config: dict[str, Any]):
    """``factory(config)`` for the factory ``path`` names: the handler a transport serves."""
    return load_factory(path)(config)
