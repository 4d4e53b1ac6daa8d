# The two commands of the README: `make demo` and `make test`. Each sets itself up on a
# fresh machine: a virtualenv in .venv, torch pinned first (a loose torch pulls gigabytes of
# CUDA wheels), the project, and the generated protobuf code.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PB     := ps/proto/hps_pb2.py
TORCH  := torch==2.13.0

.PHONY: install proto test demo bench clean

install: $(STAMP) $(PB)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Generated code is never edited nor committed; protoc is run from the venv's grpcio-tools.
$(PB): protos/ps/proto/hps.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. \
	    --pyi_out=. protos/ps/proto/hps.proto

proto: $(PB)

test: install
	$(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/hps demo

bench: install
	$(BIN)/python benchmarks/bsp_step.py

clean:
	rm -rf $(VENV) ps/proto/hps_pb2*.py ps/proto/hps_pb2*.pyi *.egg-info
