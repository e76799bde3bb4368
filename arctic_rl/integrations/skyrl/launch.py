"""``python -m arctic_rl.integrations.skyrl serve|engine [SkyRL's EngineConfig flags]``: SkyRL's own Tinker
API server (``serve``, FastAPI + its database) and engine (``engine``, started by the server) with the
``arctic`` backend registered; ``--backend`` defaults to ``arctic``."""

from __future__ import annotations

import sys

from arctic_rl.integrations.skyrl import compat

USAGE = "usage: python -m arctic_rl.integrations.skyrl {serve,engine} [--base-model M] [--backend-config JSON] ..."


def _arctic_classes() -> tuple[type, type]:
    from arctic_rl.integrations.skyrl.backend import ArcticBackend, ArcticBackendConfig

    return ArcticBackend, ArcticBackendConfig


def _with_arctic_default(argv: list[str]) -> list[str]:
    return argv if any(a == "--backend" or a.startswith("--backend=") for a in argv) else [*argv, "--backend", "arctic"]


def serve(argv: list[str]) -> None:
    """SkyRL's Tinker API server (as ``python -m skyrl.tinker.api`` runs it), its engine started here."""
    import argparse

    import uvicorn

    compat.register_arctic_backend(_arctic_classes)
    compat.launch_engine_with_this_python()
    from skyrl.tinker import api
    from skyrl.tinker.config import EngineConfig, add_model

    parser = argparse.ArgumentParser(prog="python -m arctic_rl.integrations.skyrl serve",
                                     description="SkyRL's Tinker API server with arctic-rl's backend")
    add_model(parser, EngineConfig)
    parser.add_argument("--host", type=str, default="127.0.0.1", help="Host to bind to")
    parser.add_argument("--port", type=int, default=8000, help="Port to bind to")
    args = vars(parser.parse_args(_with_arctic_default(argv)))
    api.app.state.engine_config = EngineConfig.model_validate({k: v for k, v in args.items() if k in EngineConfig.model_fields})
    uvicorn.run(api.app, host=args["host"], port=args["port"], log_config=api.get_uvicorn_log_config(),
                timeout_keep_alive=api.HTTP_KEEP_ALIVE_TIMEOUT_SECONDS)


def engine(argv: list[str]) -> None:
    """SkyRL's ``TinkerEngine`` main loop (``python -m skyrl.tinker.engine``), ``arctic`` registered."""
    compat.register_arctic_backend(_arctic_classes)
    from skyrl.tinker import engine as skyrl_engine

    sys.argv = [f"{compat.ENGINE_MODULE} engine", *argv]
    skyrl_engine.main()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "engine"):
        sys.exit(USAGE)
    (serve if argv[0] == "serve" else engine)(argv[1:])
