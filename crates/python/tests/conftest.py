"""The skip rule shared with tests/ (tests/require.py): a test that cannot run its subject fails
with the reason unless STARLING_TEST_ALLOW_SKIP=1."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))

from require import pytest_make_collect_report, pytest_runtest_makereport, require, require_module, require_root  # noqa: E402,F401
