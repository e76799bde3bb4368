"""docs/skyrl.md ("Use from SkyRL"): its complete tinker-SDK example runs as written against SkyRL's API server with
backend ``arctic`` (its model path and URL moved to this test's server)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("tinker")
README = Path(__file__).resolve().parents[2] / "docs" / "skyrl.md"


def test_readme_example_runs(skyrl_server, tiny_model_dir):
    code = re.search(r"<!-- skyrl-example -->\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    code = code.replace('"runs/skyrl/model"', repr(str(tiny_model_dir))).replace("http://127.0.0.1:8000", skyrl_server.url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/skyrl.md (Use from SkyRL)", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2"], lines
    assert all(re.fullmatch(r"step \d: loss:sum -?\d+\.\d{3} grad_norm \d+\.\d{2}", line) for line in lines), lines
