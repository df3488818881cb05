"""pytest set-up: the spawned ranks import gloo_worker from this directory, and inductor
writes its caches to a directory of this run (no stale entries from another build),
removed when the run ends.

With ARFUSE_PYTEST_NO_SKIP=1 (set by `cargo xtask test`), a skipped test or module
fails the run: in the test command a missing torch or transformers is an error, not a
pass."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # The run's own cache, removed when the run ends (the spawned ranks, which inherit
    # it, have ended by then).
    _inductor_cache = tempfile.mkdtemp(prefix="arfuse-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

NO_SKIP = os.environ.get("ARFUSE_PYTEST_NO_SKIP") == "1"
_skipped = []


def _note_skip(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid or str(report.fspath))


def pytest_collectreport(report):
    _note_skip(report)


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if NO_SKIP and _skipped and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if NO_SKIP and _skipped:
        terminalreporter.write_line(
            f"ARFUSE_PYTEST_NO_SKIP=1: {len(_skipped)} skipped, which fails this run: "
            + ", ".join(sorted(set(_skipped))),
            red=True,
        )
