#!/usr/bin/env bash
# Build the `starling` Python wheel (crates/python: its pyproject.toml,
# the Python package in crates/python/python/starling, the native module from src/lib.rs)
# plus the starling binary as the `starling` command) and install it into the current Python, with what it needs (cloudpickle:
# starling.Executor) and what its tests need (numpy, pytest, joblib,
# scikit-learn: the joblib backend's test). Idempotent: rebuilding is incremental and the wheel is reinstalled
# over any previous one.
#   PYTHON=python3.11 scripts/build-python.sh      # another interpreter
#   CARGO_TARGET_DIR=/some/dir scripts/build-python.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
wheels=$target/wheels-python

"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "maturin>=1.5,<2" numpy pytest cloudpickle joblib scikit-learn
rm -rf "$wheels"
# The wheel bundles the starling binary (the `starling` command: starling._cli execs it).
bin=$target/release/starling
[ -x "$bin" ] || (CARGO_TARGET_DIR=$target cargo build --release -p starling-cli)
mkdir -p crates/python/python/starling/bin
strip -o crates/python/python/starling/bin/starling "$bin"
(cd crates/python && CARGO_TARGET_DIR=$target "$python" -m maturin build --release --strip \
    --interpreter "$python" --out "$wheels")
"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --force-reinstall --no-deps "$wheels"/starling-*.whl
"$python" -c 'import starling; print("installed", starling.__file__)'
