"""The Python wheel is a complete install: `pip install` of the wheel that scripts/build-python.sh
(`make python`) builds gives `import starling` and the `starling` command, in a fresh venv."""
import pathlib
import subprocess
import sys

from conftest import ROOT, require, sh

WHEELS = ROOT / "target" / "wheels-python"


def test_wheel_installs_the_module_and_the_command(tmp_path):
    wheels = sorted(WHEELS.glob("starling-*.whl"))
    require(len(wheels) == 1, f"one wheel in {WHEELS} (build it: make python), found {len(wheels)}")
    venv = tmp_path / "venv"
    # --system-site-packages: the wheel's dependency (cloudpickle) comes from this Python (offline).
    sh(sys.executable, "-m", "venv", "--system-site-packages", str(venv))
    r = sh(str(venv / "bin/python"), "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall",
           "--disable-pip-version-check", str(wheels[0]), check=False, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = venv / "bin/starling"
    assert cmd.exists(), sorted(p.name for p in (venv / "bin").iterdir())
    version = sh(str(cmd), "--version").stdout.strip()
    expected = sh(str(ROOT / "target/release/starling"), "--version").stdout.strip()
    assert version == expected and version.startswith("starling "), (version, expected)
    r = sh(str(venv / "bin/python"), "-c", "import starling, os; print(starling.__file__); print(callable(starling.Executor))",
           cwd=str(tmp_path))
    where, executor = r.stdout.split()
    assert pathlib.Path(where).is_relative_to(venv), where
    assert executor == "True"
