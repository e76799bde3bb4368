"""Write a copy of a wheel without some of its folders (and their RECORD lines), for a machine that can carry only so
many bytes: ``python scripts/strip_wheel.py IN.whl OUT_DIR ray/jars/ ray/rllib/ ...``. The copy keeps the wheel's
name, so pip installs it as the package it is."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def strip_wheel(source: Path, out_dir: Path, drop: list[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    with zipfile.ZipFile(source) as whl, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in whl.infolist():
            if any(info.filename.startswith(prefix) for prefix in drop):
                continue
            data = whl.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not any(line.startswith(prefix) for prefix in drop)).encode()
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return target


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    path = strip_wheel(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
