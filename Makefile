# starling — top-level commands. See README.md.
CARGO ?= cargo
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest
BIN := target/release/starling

.PHONY: all build python demo test unit-test integration-test bench-tables bench clean

all: build

# The CLI, libstarling (.so/.a) and the restorer.
build:
	$(CARGO) build --release --workspace

# The Python package (`import starling`), built with maturin and installed into $(PYTHON).
python: build
	PYTHON=$(PYTHON) bash scripts/build-python.sh

# Build, start the embedded cluster, build a real C project through it, compare with a local build.
demo: build
	bash scripts/demo.sh

# Everything CI runs: unit tests, then end-to-end tests against real embedded clusters
# (exec, faults, WAN links, remote fork, multicast, Python).
test: build python bench-tables unit-test integration-test

unit-test:
	$(CARGO) test --release --workspace

integration-test: build python
	$(PYTEST) -v tests/ crates/python/tests

# The benchmark tables in bench/README.md must be what bench/out/*.json gives (no hand-typed figure).
bench-tables:
	$(PYTHON) bench/tables.py --check

# Benchmarks (not part of `test`): tables on stdout, JSON and PNG in bench/out/, then the
# README tables regenerated from the JSON.
bench: build
	$(PYTHON) bench/exec_bench.py
	$(PYTHON) bench/ucop_bench.py
	$(PYTHON) bench/fork_bench.py
	$(PYTHON) bench/mcdist_bench.py
	$(PYTHON) bench/executor_bench.py
	$(PYTHON) bench/tables.py

clean:
	-$(BIN) down
	$(CARGO) clean
