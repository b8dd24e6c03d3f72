"""What a test needs to run its subject, checked in one place.

A test that cannot run what it tests (not root, no FUSE, no nft, no numpy, a
missing tool) FAILS with the reason. Only `STARLING_TEST_ALLOW_SKIP=1` (see
README.md, "Tests") turns such failures into skips, for a developer who knows
what they are leaving out. The hooks below enforce the same rule for any skip
that bypasses `require` (pytest.skip, skipif, importorskip, a module skipped at
collection): pytest.ini loads this module as a plugin (`-p require`) for every
test directory.
"""
import importlib
import os
import shutil

import pytest

ALLOW_SKIP_VAR = "STARLING_TEST_ALLOW_SKIP"


def skips_allowed():
    return os.environ.get(ALLOW_SKIP_VAR) == "1"


def require(ok, reason):
    """Go on if `ok`; otherwise fail with `reason` (skip only if STARLING_TEST_ALLOW_SKIP=1)."""
    if ok:
        return
    if skips_allowed():
        pytest.skip(reason, allow_module_level=True)
    pytest.fail(f"cannot run: {reason} (set {ALLOW_SKIP_VAR}=1 to skip such tests instead)", pytrace=False)


def require_root(what):
    require(os.geteuid() == 0, f"{what} needs root")


def require_tool(name, package):
    """An executable on PATH; `package` is the Debian package that provides it."""
    path = shutil.which(name)
    require(path is not None, f"{name} not found (apt-get install -y {package})")
    return path


def require_module(name, install):
    """An importable Python module; returns it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require(False, f"Python module {name} not importable ({e}): {install}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip that did not come through `require` is a failure too, unless skips are allowed."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not skips_allowed():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped without {ALLOW_SKIP_VAR}=1 (tests must not skip silently): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at collection (pytest.skip(..., allow_module_level=True))."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not skips_allowed():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped without {ALLOW_SKIP_VAR}=1 (tests must not skip silently): {reason}"
