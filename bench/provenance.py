"""What a benchmark ran on, recorded in its JSON as `provenance` (rendered by bench/tables.py):
the commit (`git rev-parse HEAD`), whether the tree was clean (`git status --porcelain` empty),
the date, and the machine (cores, kernel, CPU model, memory)."""
import datetime
import os
import pathlib
import platform
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _git(*args):
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def _cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_gib():
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1048576, 1)
    except OSError:
        pass
    return None


def provenance():
    commit = _git("rev-parse", "HEAD")
    porcelain = _git("status", "--porcelain")
    return {
        "commit": commit.strip() if commit else None,
        "tree_clean": (porcelain.strip() == "") if porcelain is not None else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "kernel": platform.release(),
            "cpu": _cpu_model(),
            "mem_gib": _mem_gib(),
        },
    }
