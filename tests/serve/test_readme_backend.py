"""The backend docs stay true: the client config reference in docs/configuration.md is the one the config
model generates, and docs/backend.md's complete client example runs (a real core and vLLM engine, in a
subprocess), and so does its asynchronous loop (over the example's setup, with a transformers engine)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from arctic_rl.serve.config_reference import config_reference_markdown
from tests.helpers import REPO, cli_env

CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()
BACKEND = (REPO / "docs" / "backend.md").read_text()


def test_the_config_reference_is_generated_from_the_config_model():
    start = CONFIGURATION.index("<!-- config-reference -->\n") + len("<!-- config-reference -->\n")
    end = CONFIGURATION.index("<!-- /config-reference -->")
    assert CONFIGURATION[start:end].strip() == config_reference_markdown().strip(), \
        "docs/configuration.md's config reference is stale: paste config_reference_markdown()'s output"


@pytest.mark.slow
def test_the_client_example_runs(tmp_path):
    code = re.search(r"<!-- backend-example -->\n```python\n(.*?)```", BACKEND, re.S).group(1)
    code = code.replace('"runs/backend"', repr(str(tmp_path / "backend")))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 10
    assert (tmp_path / "backend" / "policy" / "config.json").is_file()
    assert (tmp_path / "backend" / "checkpoints" / "step10").exists()


@pytest.mark.slow
def test_the_asynchronous_loop_example_runs(tmp_path):
    setup = re.search(r"<!-- backend-example -->\n```python\n(.*?)\nwith ArcticRLClient", BACKEND, re.S).group(1)
    loop = re.search(r"<!-- backend-async-example -->\n```python\n(.*?)```", BACKEND, re.S).group(1)
    setup = setup.replace('"runs/backend"', repr(str(tmp_path / "backend")))
    setup = setup.replace('"engines": {"engine": "vllm"}', '"engines": {"engine": "transformers"}')  # the loop, not vLLM
    done = subprocess.run([sys.executable, "-c", setup + loop], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^batch (\d+): staleness (\d+) loss \S+$", done.stdout, re.M)
    assert [int(index) for index, _ in rows] == list(range(10))  # every batch trained once, in order, none dropped
    assert int(rows[0][1]) == 0 and all(int(staleness) in (0, 1) for _, staleness in rows)  # within the bound
