"""The ``arctic-rl`` entry point: fast --help, LightningCLI conventions, config errors."""

import re
import subprocess
import sys

import pytest

from arctic_rl.cli import build_cli, main
from tests.helpers import quickstart_config, write_config


def test_top_level_help_imports_neither_torch_nor_lightning():
    code = "import sys; from arctic_rl.cli import main; main(['--help']); print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: arctic-rl" in out and out.strip().endswith("[]")


def test_print_config_works_bare_and_with_a_task(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--print_config"])
    assert exit_info.value.code == 0
    assert "max_epochs: -1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["fit", "--model", "arctic_rl.tasks.toy.EchoDigitGRPO", "--print_config"])
    out = capsys.readouterr().out
    assert "class_path: arctic_rl.tasks.toy.EchoDigitGRPO" in out and "group_size: 8" in out and "kl_estimator: k3" in out


def test_print_config_of_the_quickstart(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/quickstart.yaml", "--print_config"])
    out = capsys.readouterr().out
    assert "class_path: arctic_rl.tasks.toy.EchoDigitGRPO" in out and "max_response_length: 8" in out


def test_malformed_yaml_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  class_path: arctic_rl.tasks.toy.EchoDigitGRPO\n  init_args: [unclosed\n")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(bad)])
    assert stopped.value.code == 2 and re.search(r"(?s)--config .*bad.yaml is not valid YAML.*line 3, column 14", capsys.readouterr().err)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(tmp_path / "missing.yaml")])
    assert stopped.value.code == 2 and re.search(r"--config .*missing.yaml: No such file", capsys.readouterr().err)


def test_unknown_class_path_names_it(tmp_path, toy_task, capsys):
    config = quickstart_config(toy_task, tmp_path, **{"model.class_path": "my_task.DoesNotExist"})
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(write_config(config, tmp_path / "c.yaml"))])
    err = capsys.readouterr().err
    assert "Problem with given class_path 'my_task.DoesNotExist'" in err and "No module named 'my_task'" in err


def test_group_size_below_two_names_the_field(tmp_path, toy_task):
    config = quickstart_config(toy_task, tmp_path, **{"model.init_args.sampling.group_size": 1})
    with pytest.raises(ValueError, match=r"model.sampling.group_size must be >= 2"):
        build_cli(["fit", "--config", str(write_config(config, tmp_path / "c.yaml"))])


def test_step_bounded_runs_get_a_progress_bar_without_an_epoch_total(tmp_path, toy_task):
    from lightning.pytorch.callbacks import TQDMProgressBar

    from arctic_rl.callbacks.progress import StepProgressBar

    path = write_config(quickstart_config(toy_task, tmp_path), tmp_path / "c.yaml")
    def description(cli, epoch):
        bar = cli.trainer.progress_bar_callback
        bar._trainer = cli.trainer  # what Lightning's setup() does
        return bar._get_train_description(epoch).strip()

    cli = build_cli(["--config", str(path)], run=False)
    assert isinstance(cli.trainer.progress_bar_callback, StepProgressBar)
    assert description(cli, 6) == "Epoch 6"  # Lightning's own bar says "Epoch 6/-2"
    # off, or the user's own bar: no second bar is added (Lightning refuses both)
    cli = build_cli(["--config", str(path), "--trainer.enable_progress_bar", "false"], run=False)
    assert cli.trainer.progress_bar_callback is None
    own = quickstart_config(toy_task, tmp_path)
    own["trainer"]["callbacks"].append({"class_path": "lightning.pytorch.callbacks.TQDMProgressBar"})
    cli = build_cli(["--config", str(write_config(own, tmp_path / "own.yaml"))], run=False)
    assert type(cli.trainer.progress_bar_callback) is TQDMProgressBar
    # an epoch-bounded run keeps the total
    cli = build_cli(["--config", str(path), "--trainer.max_epochs", "3", "--trainer.max_steps", "-1"], run=False)
    assert description(cli, 1) == "Epoch 1/2"
