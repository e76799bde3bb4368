"""``scripts/strip_wheel.py``: the copy of a wheel keeps its name and every file outside the dropped folders, byte for
byte, and its RECORD lists exactly the files it holds (pip installs it as the package it is)."""

from __future__ import annotations

import importlib.util
import zipfile

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("strip_wheel", REPO / "scripts" / "strip_wheel.py")
strip_wheel_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(strip_wheel_module)

FILES = {"pkg/__init__.py": b"x = 1\n", "pkg/core/lib.so": bytes(range(256)) * 64, "pkg/jars/big.jar": b"j" * 4096,
         "pkg/jarsfile.py": b"kept: only the folder pkg/jars/ goes\n", "pkg/web/client/app.js": b"js"}


def test_the_dropped_folders_and_their_record_lines_go_and_everything_else_stays(tmp_path):
    source = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in FILES.items()) + "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(source, "w") as whl:
        for name, data in FILES.items():
            whl.writestr(name, data)
        whl.writestr("pkg-1.0.dist-info/RECORD", record)
    out = strip_wheel_module.strip_wheel(source, tmp_path / "out", ["pkg/jars/", "pkg/web/client/"])
    assert out.name == source.name
    with zipfile.ZipFile(out) as whl:
        names = set(whl.namelist())
        assert names == {"pkg/__init__.py", "pkg/core/lib.so", "pkg/jarsfile.py", "pkg-1.0.dist-info/RECORD"}
        for name in names - {"pkg-1.0.dist-info/RECORD"}:
            assert whl.read(name) == FILES[name]
        listed = [line.split(",")[0] for line in whl.read("pkg-1.0.dist-info/RECORD").decode().splitlines()]
    assert sorted(listed) == sorted(names)
