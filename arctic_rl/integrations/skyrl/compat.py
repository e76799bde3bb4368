"""The patches SkyRL 0.4.0 needs to run arctic-rl's backend, each a named function saying what upstream
code it works around (quarantined here; nothing else in arctic-rl patches SkyRL)."""

from __future__ import annotations

import importlib
import sys
import typing
from collections.abc import Callable

ENGINE_MODULE = "arctic_rl.integrations.skyrl"  # ``python -m`` target of the engine subprocess


def import_skyrl_types_on_python311() -> None:
    """SkyRL 0.4.0 declares Requires-Python >= 3.12. On 3.11 ``skyrl/tinker/types.py`` fails at import:
    pydantic refuses ``typing.TypedDict`` (its ``MultiModalKwargs``) before Python 3.12 ("Please use
    ``typing_extensions.TypedDict``"). Import that module once with ``typing_extensions``' TypedDict in
    ``typing``'s place, then put ``typing`` back. A no-op on 3.12+ or once imported."""
    if sys.version_info >= (3, 12) or "skyrl.tinker.types" in sys.modules:
        return
    import typing_extensions

    original = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        importlib.import_module("skyrl.tinker.types")
    finally:
        typing.TypedDict = original


def register_arctic_backend(load_classes: Callable[[], tuple[type, type]]) -> None:
    """SkyRL 0.4.0's ``skyrl.tinker.engine.get_backend_classes`` knows only ``jax``, ``fsdp`` and
    ``megatron`` (an if/elif, no registry): wrap it so ``--backend arctic`` picks the classes ``load_classes()``
    returns (the backend and its config; loaded when asked for, so SkyRL's engine imports them only then)."""
    import_skyrl_types_on_python311()
    from skyrl.tinker import engine

    upstream = engine.get_backend_classes
    if getattr(upstream, "arctic_rl_wrapped", False):
        return

    def get_backend_classes(backend_name: str, use_ray: bool = False):
        if backend_name == "arctic":
            return load_classes()
        return upstream(backend_name, use_ray=use_ray)

    get_backend_classes.arctic_rl_wrapped = True
    engine.get_backend_classes = get_backend_classes


def launch_engine_with_this_python() -> None:
    """SkyRL 0.4.0's API server starts its engine as ``uv run <the API's uv flags> --extra tinker --extra
    <backend> -m skyrl.tinker.engine`` (``skyrl.tinker.api._build_uv_run_cmd_engine``), which needs uv and
    an API started by ``uv run``. Start it with this interpreter and environment instead, through this
    package, so the engine process gets the same fixes and the ``arctic`` backend."""
    import_skyrl_types_on_python311()
    from skyrl.tinker import api
    from skyrl.tinker.config import config_to_argv

    def build_engine_command(parent_cmd: list[str], engine_config) -> list[str]:
        return [sys.executable, "-m", ENGINE_MODULE, "engine", *config_to_argv(engine_config)]

    api._build_uv_run_cmd_engine = build_engine_command
