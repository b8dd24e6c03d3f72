"""Shared fixtures: a real embedded cluster started with the project's own commands."""
import json
import os
import pathlib
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target" / "release" / "starling")


def sh(*args, check=True, timeout=300, **kw):
    """Run a command, return CompletedProcess (text mode)."""
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=timeout, **kw)


def starling(*args, **kw):
    return sh(STARLING, *args, **kw)


def status():
    return json.loads(starling("status", "--json").stdout)


def up(hosts=4):
    starling("down", check=False)
    r = starling("up", "--hosts", str(hosts), check=False, timeout=120)
    assert r.returncode == 0, f"starling up failed:\n{r.stdout}\n{r.stderr}"
    return status()


def down():
    return starling("down", check=False, timeout=120)


@pytest.fixture(scope="session")
def cluster():
    """A 4-host embedded cluster for the whole session (destructive tests make their own)."""
    st = up(4)
    yield st
    down()


@pytest.fixture
def workdir(tmp_path):
    """A scratch directory on the real disk (tmp_path is under /tmp, which tasks see too)."""
    d = pathlib.Path("/var/tmp/starling-tests") / tmp_path.name
    d.mkdir(parents=True, exist_ok=True)
    yield d
    subprocess.run(["rm", "-rf", str(d)])


def lua_src():
    return subprocess.run([str(ROOT / "tests/fixtures/fetch-lua.sh")], capture_output=True, text=True, check=True).stdout.strip()
