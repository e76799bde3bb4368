"""``check_target``: the one check of a save_state / load_state / export path, on a real folder (the service
cases, against the real server at ZeRO stages 0 and 1, are in test_service_guards.py)."""

from __future__ import annotations

import pytest

from arctic_rl.serve.errors import PathRefused, RequestError
from arctic_rl.serve.targets import MANIFEST, STATE_FILE, check_target, write_manifest


@pytest.fixture
def root(tmp_path):
    """``root/`` with a folder of the user's, a file, a saved state (stage 0) and an export."""
    base = tmp_path / "root"
    (base / "mine").mkdir(parents=True)
    (base / "notes.json").write_text("{}")
    for name, kind in (("states/a", "state"), ("policy", "export")):
        (base / name).mkdir(parents=True)
        write_manifest(base / name, kind, zero_stage=0, step=3)
    (base / "states" / "a" / STATE_FILE).write_bytes(b"x")
    return base


@pytest.mark.parametrize("operation", ["save_state", "export"])
def test_writes_go_to_new_folders_or_ones_of_the_same_kind(root, operation):
    assert check_target(root, "new/folder", operation, 0) == root / "new" / "folder"
    own = "states/a" if operation == "save_state" else "policy"
    assert check_target(root, own, operation, 1) == root / own


@pytest.mark.parametrize("path, operation, message", [
    (".", "save_state", "is the server's root_dir itself"),
    ("x/..", "export", "is the server's root_dir itself"),
    ("mine", "save_state", "already exists and the service did not write it"),
    ("notes.json", "export", "already exists and the service did not write it"),
    ("notes.json/x", "save_state", "'notes.json' is a file, not a folder"),
    ("states/a/inner", "save_state", "is inside 'states/a', a folder the service wrote"),
    ("policy", "save_state", "holds a export the service wrote, not a state"),
    ("../x", "save_state", "is outside the server's root_dir"),
])
def test_targets_refused_with_403(root, path, operation, message):
    with pytest.raises(PathRefused, match=message) as refused:
        check_target(root, path, operation, 0)
    assert refused.value.status == 403 and str(root) not in str(refused.value)


@pytest.mark.parametrize("path, zero_stage, message", [
    ("mine", 0, "path 'mine' is a folder save_state did not write, not a saved state"),
    ("notes.json", 0, "path 'notes.json' is a file, not a saved state"),
    ("policy", 0, "path 'policy' is a folder save_state did not write"),
    ("nothing", 0, "path 'nothing': no saved state there"),
    ("states/a", 1, "was saved with training.zero_stage=0; this job trains with zero_stage=1"),
    ("x" * 5000, 0, "path is 5000 characters long; at most 1024"),
    ("a/" + "y" * 300, 0, "path has a component of 300 bytes"),
])
def test_loads_and_long_paths_refused_with_400(root, path, zero_stage, message):
    with pytest.raises(RequestError, match=message) as refused:
        check_target(root, path, "load_state", zero_stage)
    assert refused.value.status == 400
    assert check_target(root, "states/a", "load_state", 0) == root / "states" / "a"


def test_the_manifest_is_the_services_mark(root):
    (root / "mine" / MANIFEST).write_text('{"kind": "something else"}')
    with pytest.raises(PathRefused, match="did not write it"):
        check_target(root, "mine", "save_state", 0)
