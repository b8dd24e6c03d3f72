# starling — top-level commands. See README.md.
CARGO ?= cargo
PYTEST ?= python3 -m pytest
BIN := target/release/starling

.PHONY: all build demo test unit-test integration-test bench clean

all: build

build:
	$(CARGO) build --release --workspace

# Build, start the embedded cluster, build a real C project through it, compare with a local build.
demo: build
	bash scripts/demo.sh

# Everything CI runs: unit tests, then integration tests against a real embedded cluster.
test: build unit-test integration-test

unit-test:
	$(CARGO) test --release --workspace

integration-test: build
	$(PYTEST) -v tests/

bench: build
	python3 bench/exec_bench.py

clean:
	-$(BIN) down
	$(CARGO) clean
