"""The service's guards: loopback detection, the bind check, bearer tokens and path confinement."""

import os

import pytest

from arctic_rl.errors import ConfigError
from arctic_rl.serve.errors import AuthError, PathRefused
from arctic_rl.serve.security import check_bearer, check_bind, confine_path, is_loopback


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True),
    ("127.0.0.53", True),
    ("::1", True),
    ("[::1]", True),
    ("::ffff:127.0.0.1", True),
    ("localhost", True),
    ("LOCALHOST.", True),
    ("0.0.0.0", False),
    ("::", False),
    ("", False),
    ("10.0.0.1", False),
    ("::ffff:10.0.0.1", False),
    ("example.com", False),
    ("localhost.example.com", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host, token, refused", [
    ("127.0.0.1", None, False),
    ("localhost", "", False),
    ("0.0.0.0", "s3cret", False),
    ("0.0.0.0", None, True),
    ("0.0.0.0", "", True),
    ("10.1.2.3", None, True),
])
def test_check_bind(host, token, refused):
    if not refused:
        check_bind(host, token)
        return
    with pytest.raises(ConfigError, match=rf"refusing to listen on {host} without an auth token: set auth_token or ARCTIC_RL_TOKEN"):
        check_bind(host, token)


@pytest.mark.parametrize("header, expected, error", [
    (None, None, None),
    ("Bearer anything", None, None),
    ("Bearer s3cret", "s3cret", None),
    ("bearer   s3cret  ", "s3cret", None),
    ("Bearer s3cr\u00e9t", "s3cr\u00e9t", None),
    (None, "s3cret", "missing Authorization header"),
    ("s3cret", "s3cret", "malformed Authorization header"),
    ("Basic s3cret", "s3cret", "malformed Authorization header"),
    ("Bearer ", "s3cret", "malformed Authorization header"),
    ("Bearer s3cre", "s3cret", "wrong bearer token"),
    ("Bearer s3crett", "s3cret", "wrong bearer token"),
    ("Bearer x", "", "wrong bearer token"),
])
def test_check_bearer(header, expected, error):
    if error is None:
        check_bearer(header, expected)
        return
    with pytest.raises(AuthError, match=error) as info:
        check_bearer(header, expected)
    assert "s3cr" not in str(info.value)  # neither token is echoed
    assert info.value.status == 401


@pytest.fixture
def root(tmp_path):
    """``root/`` with a file, a subfolder, links inside and out, and a secret beside it."""
    base = tmp_path / "root"
    (base / "sub").mkdir(parents=True)
    (base / "sub" / "file.bin").write_bytes(b"x")
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", base / "out_link")
    os.symlink(base / "sub", base / "in_link")
    os.symlink(base / "loop_a", base / "loop_b")
    os.symlink(base / "loop_b", base / "loop_a")
    return base


@pytest.mark.parametrize("requested, inside", [
    ("ckpt/step_1", "ckpt/step_1"),
    ("sub/file.bin", "sub/file.bin"),
    ("sub/../sub/new", "sub/new"),
    ("./sub", "sub"),
    (".", "."),
    ("in_link/x", "sub/x"),
    ("~/x", "~/x"),  # no home expansion: a folder named "~" under root
])
def test_confine_path_accepts_paths_inside_root(root, requested, inside):
    assert confine_path(root, requested) == (root / inside).resolve()


def test_confine_path_accepts_an_absolute_path_inside_root(root):
    assert confine_path(str(root), str(root / "sub" / "file.bin")) == root / "sub" / "file.bin"


@pytest.mark.parametrize("requested, reason", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("..", "outside the server's root_dir"),
    ("../secret", "outside the server's root_dir"),
    ("sub/../../secret", "outside the server's root_dir"),
    ("/etc/passwd", "outside the server's root_dir"),
    ("out_link", "outside the server's root_dir"),
    ("out_link/stolen.bin", "outside the server's root_dir"),
    ("loop_a/x", "cannot be resolved"),
    ("ckpt\x00/x", "contains a NUL byte"),
    (None, "path must be a string"),
])
def test_confine_path_refuses_escapes(root, requested, reason):
    with pytest.raises(PathRefused, match=reason) as info:
        confine_path(root, requested)
    if requested:
        assert repr(requested) in str(info.value)  # names the path
    assert info.value.status == 403


def test_confine_path_refuses_an_absolute_path_to_a_sibling_with_the_same_prefix(tmp_path):
    (tmp_path / "root").mkdir()
    with pytest.raises(PathRefused):
        confine_path(tmp_path / "root", str(tmp_path / "root2" / "x"))


def test_confine_path_creates_a_missing_root(tmp_path):
    assert confine_path(tmp_path / "a" / "b", "c") == (tmp_path / "a" / "b" / "c").resolve()
    assert (tmp_path / "a" / "b").is_dir()
