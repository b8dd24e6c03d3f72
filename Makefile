# starling — top-level commands. See README.md.
CARGO ?= cargo
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest
BIN := target/release/starling
# `make install`: the binary, libstarling and its header, and systemd units for `starling head` and
# `starling agent` (enable one: systemctl enable --now starling-agent). DESTDIR for staging.
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
UNITDIR ?= /etc/systemd/system

.PHONY: all build python demo test unit-test integration-test bench-tables bench fuzz fuzz-smoke clean install uninstall

all: build

# The CLI, libstarling (.so/.a) and the restorer.
build:
	$(CARGO) build --release --workspace

# The Python package (`import starling`), built with maturin and installed into $(PYTHON).
python: build
	PYTHON=$(PYTHON) bash scripts/build-python.sh

# Build, start the embedded cluster, build a real C project through it, compare with a local build.
demo: build python
	bash scripts/demo.sh

# Everything CI runs: unit tests, then end-to-end tests against real embedded clusters
# (exec, faults, WAN links, remote fork, multicast, live migration, Python, Slurm, rootless agents).
test: build python bench-tables unit-test fuzz-smoke integration-test

unit-test:
	$(CARGO) test --release --workspace

# Two pytest processes: the Python package's tests clone the pytest process itself (remote fork),
# so they run in one of their own rather than in one that has run every other suite first.
integration-test: build python
	$(PYTEST) -v tests/
	$(PYTEST) -v crates/python/tests

# libFuzzer targets (fuzz/: every decoder of bytes from another machine), run by scripts/fuzz.sh with
# cargo-fuzz on a nightly toolchain (.ci/run installs both): fuzz-smoke runs each target briefly from
# its committed corpus (part of `test`); fuzz runs each for 10 million executions.
fuzz-smoke:
	bash scripts/fuzz.sh smoke $(FUZZ_SECONDS)
fuzz:
	bash scripts/fuzz.sh full $(FUZZ_RUNS)

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
	$(PYTHON) bench/migrate_bench.py
	$(PYTHON) bench/data_bench.py
	$(PYTHON) bench/slurm_bench.py
	$(PYTHON) bench/executor_bench.py
	$(PYTHON) bench/linger_sim.py
	$(PYTHON) bench/tables.py

install:
	@test -x $(BIN) -a -f target/release/libstarling.a || { echo "build first: make build"; exit 1; }
	install -D -m 0755 $(BIN) $(DESTDIR)$(BINDIR)/starling
	install -D -m 0644 target/release/libstarling.a $(DESTDIR)$(LIBDIR)/libstarling.a
	install -D -m 0755 target/release/libstarling.so $(DESTDIR)$(LIBDIR)/libstarling.so
	install -D -m 0644 include/starling.h $(DESTDIR)$(INCLUDEDIR)/starling.h
	for u in starling-head starling-agent; do \
		install -d $(DESTDIR)$(UNITDIR); \
		sed 's|@BINDIR@|$(BINDIR)|g' packaging/systemd/$$u.service > $(DESTDIR)$(UNITDIR)/$$u.service; \
		chmod 0644 $(DESTDIR)$(UNITDIR)/$$u.service; \
	done
	@echo "installed; configure /etc/starling/config.toml, then: systemctl daemon-reload && systemctl enable --now starling-agent (or starling-head)"

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/starling $(DESTDIR)$(LIBDIR)/libstarling.a $(DESTDIR)$(LIBDIR)/libstarling.so \
		$(DESTDIR)$(INCLUDEDIR)/starling.h $(DESTDIR)$(UNITDIR)/starling-head.service $(DESTDIR)$(UNITDIR)/starling-agent.service

clean:
	-$(BIN) down
	$(CARGO) clean
