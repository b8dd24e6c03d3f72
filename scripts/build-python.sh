#!/usr/bin/env bash
# Build the `starling` Python wheel (crates/python via python/pyproject.toml)
# and install it into the current Python, with what its tests need (numpy,
# pytest). Idempotent: rebuilding is incremental and the wheel is reinstalled
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

"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "maturin>=1.5,<2" numpy pytest
rm -rf "$wheels"
(cd python && CARGO_TARGET_DIR=$target "$python" -m maturin build --release --strip \
    --interpreter "$python" --out "$wheels")
"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --force-reinstall --no-deps "$wheels"/starling-*.whl
"$python" -c 'import starling; print("installed", starling.__file__)'
