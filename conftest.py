"""How the test suites (``tests/``, ``integration_tests/``) are spread over pytest-xdist workers: ``pyproject.toml``'s
addopts run them on 2 workers with ``--dist loadgroup``, which this file refines.

- A unit of work is a test file, so a module-scoped fixture (a Ray cluster, an engine) is built once.
- The files that share an expensive session-scoped fixture (``SHARED_SESSION_FIXTURES``) form one unit, so that
  fixture is built on one worker only.
- The files holding ``slow`` tests are handed out first, so the many short files fill the end of the run on both
  workers instead of one long file running alone at the end.
"""

from __future__ import annotations

import os

import pytest

# One OpenMP thread per process: the suite runs on two workers, each starting engines, ranks and Ray workers of its
# own, so every core is already taken; a second thread per process only spins and contends (measured on the 2-core CI
# machine: -11% wall, -12% CPU on the heavy files; docs/testing.md). Set before any test imports torch, and inherited
# by every process the tests start. A value the caller set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# session-scoped fixture -> the unit every test using it runs in
SHARED_SESSION_FIXTURES = {"quickstart_cli_runs": "quickstart_cli_runs", "reference_run": "resume_runs",
                           "short_run": "resume_runs", "recipe_smokes": "recipe_smokes"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: otherwise the files' own order
    for item in items:
        groups = {SHARED_SESSION_FIXTURES[name] for name in item.fixturenames if name in SHARED_SESSION_FIXTURES}
        if groups:
            item.add_marker(pytest.mark.xdist_group("+".join(sorted(groups))))


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: a test marked ``xdist_group`` runs in its group's unit, every other test in its file's."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = super()._split_scope(nodeid)  # the group's name, or the test's own id
            return nodeid.split("::", 1)[0] if group == nodeid else group

    return FileOrGroupScheduling(config, log)
