"""``arctic-rl``: a thin LightningCLI. ``arctic-rl --help`` answers without importing torch or
Lightning; subcommands (``fit``, ``validate``, ...) build the full CLI.

    arctic-rl fit --config quickstart                 # the built-in quickstart (arctic_rl/builtin/), from any directory
    arctic-rl fit --config configs/quickstart.yaml
    arctic-rl fit --config configs/quickstart.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt
    arctic-rl fit --print_config
"""

from __future__ import annotations

import os
import sys

USAGE = """usage: arctic-rl [-h] [--version] {fit,validate,serve,prepare,plot} ...

GRPO post-training for LLMs, Lightning-style (LightningCLI conventions).

subcommands:
  fit         train: arctic-rl fit --config x.yaml [--trainer.max_steps 100] [--ckpt_path last.ckpt]
              arctic-rl fit --config quickstart   the built-in CPU quickstart (writes ./runs/quickstart)
              arctic-rl fit --print_config   shows every option with its default
              arctic-rl fit --help           lists every option
  serve       the backend service other RL frameworks drive (ArcticRLClient over HTTP):
              arctic-rl serve --config client.yaml [--host 127.0.0.1] [--port 8000]   (docs/backend.md)
              arctic-rl serve --api tinker --config client.yaml   the Tinker SDK's API (docs/tinker.md)
              arctic-rl serve --api openai --config client.yaml   OpenAI's chat API, episodes recorded (docs/agents.md)
  prepare     a recipe's prompt data (recipes/<name>/README.md): arctic-rl prepare gsm8k|multihop_qa|bird|search_agent --out DIR [--source ...]
  plot        a run's curves (reward, accuracy, length, KL/entropy, timing, dedup) to a PNG:
              arctic-rl plot RUN_DIR [--out curves.png]

The YAML holds model (a GRPOModule subclass: class_path/init_args), data (a PromptDataModule),
trainer (strategy, callbacks, logger). See README.md, docs/configuration.md and configs/quickstart.yaml.
Relative paths in a config file resolve against the file's directory (command-line values against
the current one), and a task module beside the config imports as class_path: my_task.MyGRPO.
"""


def _environment_defaults() -> None:
    """W&B offline unless the user has credentials or chose a mode; quiet, offline-safe defaults."""
    has_wandb_login = "WANDB_API_KEY" in os.environ or os.path.exists(os.path.expanduser("~/.netrc"))
    if not has_wandb_login:
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from arctic_rl.rollout.engines.vllm.env import apply_vllm_env_defaults

    apply_vllm_env_defaults()


def default_logger() -> dict:
    """W&B when installed (offline without credentials), else CSV."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        return {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "arctic-rl", "save_dir": "."}}
    return {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}}


PARSER_MODE = "arctic_yaml"  # YAML, with the old flat model options moved into their sections (flat_options.py)


def _use_config_loader() -> None:
    """Config files and values are read as YAML, and the flat ``model.init_args`` keys of the last release are
    moved into their sections with a warning naming the new key (``modules/flat_options.upgrade_config``)."""
    import yaml
    from jsonargparse import get_loader, set_loader

    from arctic_rl.modules.flat_options import upgrade_config

    yaml_load = get_loader("yaml")
    set_loader(PARSER_MODE, lambda text: upgrade_config(yaml_load(text)), exceptions=(yaml.YAMLError,))


def build_cli(args: list[str] | None = None, run: bool = True):
    from lightning.pytorch.cli import LightningCLI

    from arctic_rl.modules.flat_options import upgrade_args

    from arctic_rl.cluster.launch import RayTrainConfig, is_ray_train_worker, ray_trainer_overrides
    from arctic_rl.data.prompts import PromptDataModule
    from arctic_rl.modules.grpo import GRPOModule

    class ArcticCLI(LightningCLI):
        """LightningCLI plus the top-level ``ray`` section (read by the launcher, ignored here), reading
        the old flat model options (``PARSER_MODE``)."""

        def init_parser(self, **kwargs):
            return super().init_parser(parser_mode=PARSER_MODE, **kwargs)

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument("--ray", type=RayTrainConfig | None, default=None, help="Ray Train launch (see docs/gpu.md)")

        def before_instantiate_classes(self) -> None:
            """``--trainer.strategy pkg.Class`` (a class path given as a plain string) means that class."""
            from jsonargparse import Namespace

            config = self.config[self.subcommand] if self.subcommand else self.config
            strategy = config.trainer.strategy
            if isinstance(strategy, str) and "." in strategy:
                config.trainer.strategy = Namespace(class_path=strategy, init_args=Namespace())

        def _parse_ckpt_path(self) -> None:
            """``--ckpt_path``: the run's config is used as given and checked against the checkpoint's
            hyperparameters (``arctic_rl.resume_policy``), instead of silently replaced by them."""
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if ckpt_path:
                from arctic_rl.resume_policy import check_resume_config

                check_resume_config(ckpt_path, self.config[subcommand].model.init_args.as_dict())

        def parse_arguments(self, parser, args) -> None:
            """Then check ``--ckpt_path`` (``preflight.py``): LightningCLI loads it right after parsing."""
            from arctic_rl.preflight import check_checkpoint

            super().parse_arguments(parser, args)
            subcommand = self.config.get("subcommand")
            check_checkpoint(self.config[subcommand].get("ckpt_path") if subcommand else None)

        def before_fit(self) -> None:
            """Checks before anything expensive starts (``preflight.py``)."""
            from arctic_rl.preflight import check_fit
            from arctic_rl.temp_dirs import release_tempfile

            check_fit(self.trainer, self.config[self.subcommand].ckpt_path, self.model)
            # training runs with tempfile on $TMPDIR (torch.compile's caches); W&B's staging stays in the run's dir
            release_tempfile(stage_wandb=any(type(lg).__name__ == "WandbLogger" for lg in self.trainer.loggers))

        def _instantiate_trainer(self, config, callbacks):
            if is_ray_train_worker():
                config = ray_trainer_overrides(dict(config))
            from arctic_rl.console import RunLogFile

            return super()._instantiate_trainer(config, [*callbacks, *default_progress_bar(config, callbacks), RunLogFile()])

    _use_config_loader()
    if args is None:
        sys.argv[1:] = upgrade_args(sys.argv[1:])  # --model.init_args.<flat key> flags
    else:
        args = upgrade_args(args)
    return ArcticCLI(
        GRPOModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"logger": default_logger(), "max_epochs": -1},
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def default_progress_bar(trainer_config: dict, callbacks: list) -> list:
    """``[StepProgressBar()]`` where Lightning would otherwise pick its own Rich bar: the progress bar is
    on, Rich is installed, and the config names no progress bar of its own."""
    from lightning.pytorch.callbacks import ProgressBar

    from arctic_rl.patches.lightning import rich_available

    if trainer_config.get("enable_progress_bar") is False or not rich_available():
        return []
    configured = trainer_config.get("callbacks") or []
    configured = configured if isinstance(configured, list) else [configured]
    if any(isinstance(c, ProgressBar) for c in [*configured, *callbacks]):
        return []
    from arctic_rl.callbacks.progress import StepProgressBar

    return [StepProgressBar()]


def check_config_files(argv: list[str]) -> None:
    """Parse each ``--config FILE`` as YAML first, so a syntax error names the file and line
    (jsonargparse would report it against "<unicode string>"), and a name that is no file lists the
    built-in configs. Raises ``ConfigError``."""
    import yaml

    from arctic_rl.errors import ConfigError

    from arctic_rl.config_paths import config_file_args, resolved_source

    for _, path in config_file_args(argv):
        if resolved_source(path) is not None:
            continue  # a config this command's first process resolved (Lightning passes it to the other ranks)
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except FileNotFoundError as e:
            from arctic_rl.config_paths import missing_config_hint

            raise ConfigError(f"--config {path}: {e.strerror}; {missing_config_hint(path)}") from None
        except OSError as e:
            raise ConfigError(f"--config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path} is not valid YAML: {e}") from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"arctic-rl {version('arctic-rl')}")
        return
    if argv[0] == "prepare":  # a recipe's data: arctic-rl prepare gsm8k|multihop_qa|bird|search_agent --out DIR [...]
        from arctic_rl.recipes import prepare_main

        prepare_main(argv[1:])
        return
    if argv[0] == "plot":  # a run's curves to a PNG (arctic_rl/plot.py): no torch, no Lightning
        from arctic_rl.plot import main as plot_main

        plot_main(argv[1:])
        return
    from arctic_rl.config_paths import builtin_config_args

    from_command_line = argv == sys.argv[1:]
    from arctic_rl.errors import exit_on_config_error

    argv = builtin_config_args(argv)  # --config quickstart: a config shipped in the package (config_paths.py)
    with exit_on_config_error():
        check_config_files(argv)
    _environment_defaults()
    if argv[0] == "serve":  # the backend service: its own small argument parser (arctic_rl/serve/server.py)
        from arctic_rl.serve.server import main as serve_main

        with exit_on_config_error():
            sys.exit(serve_main(argv[1:]))
    from arctic_rl.config_paths import config_dirs, resolve_config_args
    from arctic_rl.console import route_console
    from arctic_rl.temp_dirs import run_temp_files

    with exit_on_config_error(), run_temp_files(), route_console():
        ray_cfg = None
        if argv[0] == "fit":
            from arctic_rl.cluster.launch import ray_section

            ray_cfg = ray_section(argv)
        import_dirs = config_dirs(argv)
        argv = resolve_config_args(argv)  # paths in a config are relative to its file (config_paths.py)
        if from_command_line:
            sys.argv[1:] = argv
        if ray_cfg is not None and ray_cfg.num_workers > 0:
            from arctic_rl.cluster.launch import launch

            launch(argv, ray_cfg, build_cli, import_dirs)
            return
        cli = build_cli(None if from_command_line else argv)  # None: LightningCLI reads sys.argv without a warning
    if cli.subcommand == "fit":
        from arctic_rl.callbacks.preemption import exit_code

        if exit_code(cli.trainer):
            sys.exit(exit_code(cli.trainer))  # stopped by SIGTERM: a checkpoint was saved, requeue-friendly code


if __name__ == "__main__":
    main()
