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


# A test that hangs must not hang the whole run until CI's time limit, with nothing said: after
# STARLING_TEST_HANG_SECONDS (default 1200, many times the slowest test's time on a 2-core machine)
# the watchdog prints every Python thread's stack and the process tree with each process's kernel
# wait channel, then ends the run (exit 70). It cannot fail just the one test: the hang may be inside
# native code that no Python exception interrupts.
HANG_SECONDS_VAR = "STARLING_TEST_HANG_SECONDS"
_ERR_FD = os.dup(2)  # the real stderr: imported (-p require) before pytest captures fd 2


def _hang_report(nodeid, seconds):
    import faulthandler
    import subprocess

    os.write(_ERR_FD, f"\n=== WATCHDOG: {nodeid} still running after {seconds} s ({HANG_SECONDS_VAR}) ===\n".encode())
    faulthandler.dump_traceback(file=_ERR_FD, all_threads=True)
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:30,etime,args", "--forest"], capture_output=True, text=True)
    os.write(_ERR_FD, ps.stdout.encode())
    for line in ps.stdout.splitlines()[1:]:
        pid = line.split()[0]
        if "starling" in line or "python" in line or "restorer" in line:
            try:
                stack = open(f"/proc/{pid}/stack").read()
            except OSError:
                continue
            os.write(_ERR_FD, f"--- /proc/{pid}/stack ({line.strip()[:100]})\n{stack}".encode())
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import threading

    seconds = float(os.environ.get(HANG_SECONDS_VAR, "1200"))
    timer = threading.Timer(seconds, _hang_report, (item.nodeid, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
