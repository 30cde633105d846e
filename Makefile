# Checkmate: one command to set up, one to test, one to run the demo.
#   make setup   system packages (root), .venv, torch 2.13.0, the project [dev]
#   make test    setup + the test suite (root-only tests skip when not root; BMv2/p4c ones when absent)
#   make demo    setup + the end-to-end demo (root; DEMO_ARGS="--help" for its options)
#   make p4      compile p4src/ with p4c (BMv2) into build/ when p4c is installed
#   make p4-tofino  compile p4src/tna/ with the open-source Tofino compiler into build/tofino/ (TOFINO_TARGET=tofino2)
#   make lint    ruff + mypy
#   make bench   the checkpointing systems side by side (root; results/bench.json, docs/benchmarks.md)
#   make bench-switch / bench-hosts / bench-shadow / bench-scaling   component and scaling benchmarks (root but shadow)
#   make reliability / make soak   the reliability suite (quick / with soak cases) -> docs/reliability.md
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.checkmate-setup
APT_PACKAGES := mininet ethtool iproute2 iputils-ping tcpdump nfs-ganesha nfs-ganesha-vfs rpcbind libnfs13
TORCH_VERSION := 2.13.0
# Where pip finds torch. Empty: pip's configured indexes only. TORCH_INDEX=<url> adds a
# package index of your choice (e.g. PyTorch's CPU wheel index) before them, so a machine
# without a local CPU wheel need not download the multi-GB CUDA build.
TORCH_INDEX ?=
BUILD := build
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: help setup system-packages test demo p4 p4-tofino lint bench bench-scaling bench-switch bench-hosts bench-shadow reliability soak clean

help:
	@sed -n '1,10p' Makefile | sed 's/^# \{0,1\}//'

setup: system-packages $(STAMP)

system-packages:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "make setup: these Debian packages are missing and installing them needs root:$$missing"; \
	  echo "  run: sudo apt-get update && sudo apt-get install -y$$missing   (or run make setup as root)"; \
	  exit 1; \
	fi; \
	echo "make setup: installing$$missing"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing

$(STAMP): pyproject.toml setup.py embedded_switch/native/_datapath.c hosts/native/datapath.c hosts/native/sha256.h
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION) numpy
	$(PY) -m pip install -q -e '.[dev]'
	@# Debian's Mininet lives in the system dist-packages: link that one package into .venv (idempotent).
	@$(PY) -m topologies.mininet_import --link
	@touch $(STAMP)
	@echo "make setup: .venv ready"

test: setup
	@# With p4c on PATH, compile the v1model program first (under a second) so the BMv2 tests have its JSON.
	@if command -v p4c >/dev/null 2>&1; then $(MAKE) --no-print-directory p4; fi
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "make demo: needs root (network namespaces, veth pairs and a software switch in Mininet): sudo make demo"; \
	  exit 1; \
	fi
	@if command -v p4c >/dev/null 2>&1; then $(MAKE) --no-print-directory p4; fi
	$(PY) -m experiments.demo $(DEMO_ARGS)

p4:
	@if ! command -v p4c >/dev/null 2>&1; then \
	  echo "make p4: p4c is not installed (it is not in Debian 12's or PyPI's registries);"; \
	  echo "  install p4c from p4lang, then run make p4 again. p4src/checkmate.p4info.txtpb is committed."; \
	  exit 1; \
	fi
	mkdir -p $(BUILD)/v1model
	p4c --target bmv2 --arch v1model --std p4-16 \
	  --p4runtime-files $(BUILD)/v1model/checkmate.p4info.txtpb \
	  -o $(BUILD)/v1model p4src/v1model/checkmate.p4
	@echo "make p4: wrote $(BUILD)/v1model/checkmate.json and checkmate.p4info.txtpb"

# Tofino 1 (tna) or Tofino 2 (t2na): p4c-barefoot to .bfa, bfas to the binary, then a resource summary.
TOFINO_TARGET ?= tofino

p4-tofino:
	@if ! command -v p4c-barefoot >/dev/null 2>&1 || ! command -v bfas >/dev/null 2>&1; then \
	  echo "make p4-tofino: the open-source Tofino compiler (p4c-barefoot, bfas) is not on PATH;"; \
	  echo "  bash ../shared/p4-tofino/install.sh && export PATH=/opt/p4-tofino/bin:\$$PATH (docs/tofino.md)."; \
	  echo "  p4src/tna/checkmate.tofino.p4info.txtpb is committed."; \
	  exit 1; \
	fi
	$(PYTHON) -m tests.tofino_build --target $(TOFINO_TARGET) --out $(BUILD)/$(TOFINO_TARGET) \
	  --json $(BUILD)/$(TOFINO_TARGET)/resources-summary.json
	@echo "make p4-tofino: wrote $(BUILD)/$(TOFINO_TARGET)/pipe/ (checkmate.bfa, context.json, the binary) and checkmate.p4info.txtpb"

BENCH_ARGS ?=

bench: setup
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "make bench: needs root (the demo's emulated network: namespaces, veth pairs, a software switch): sudo make bench"; \
	  exit 1; \
	fi
	$(PY) -m experiments.bench $(BENCH_ARGS)

bench-scaling: setup
	@if [ "$$(id -u)" != 0 ]; then echo "make bench-scaling: needs root (the emulated network)"; exit 1; fi
	$(PY) -m experiments.bench.scaling $(BENCH_ARGS)

bench-switch: setup
	@if [ "$$(id -u)" != 0 ]; then echo "make bench-switch: needs root (network namespaces)"; exit 1; fi
	@# Both data paths of the embedded switch, then BMv2 when simple_switch_grpc is on PATH (p4c compiles its JSON).
	@if command -v p4c >/dev/null 2>&1; then $(MAKE) --no-print-directory p4; fi
	$(PY) -m experiments.bench.switch $(BENCH_ARGS)

bench-hosts: setup
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "make bench-hosts: needs root (the emulated network: namespaces, veth pairs, a software switch)"; \
	  exit 1; \
	fi
	$(PY) -m hosts.benchmark $(BENCH_ARGS)
	$(PY) -m experiments.bench.transport topologies/single.json $(BENCH_ARGS)

bench-shadow: setup
	$(PY) -m experiments.bench.shadow --json results/shadow_bench.json $(BENCH_ARGS)

RELIABILITY_ROWS := results/reliability-rows.jsonl

reliability: setup
	@mkdir -p results && rm -f $(RELIABILITY_ROWS)
	@# The table is written even when a test fails (its row says so); then exit non-zero.
	@status=0; CHECKMATE_RELIABILITY_OUT=$(RELIABILITY_ROWS) $(PY) -m pytest tests/reliability $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m tests.reliability.report $(RELIABILITY_ROWS) --out docs/reliability.md --command "make reliability" \
	  || status=$$(( status ? status : 1 )); exit $$status

soak: setup
	@mkdir -p results && rm -f $(RELIABILITY_ROWS)
	@# The table is written even when a test fails (its row says so); then exit non-zero.
	@# Then the 2,000-iteration soak and the slow-shadow run write the figures of the table's last section.
	@status=0; CHECKMATE_RELIABILITY_OUT=$(RELIABILITY_ROWS) $(PY) -m pytest tests/reliability -m 'not slow' $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m tests.shadow.soak --steps 2000 --restart-every 500 --json results/soak.json || status=$$(( status ? status : 1 )); \
	$(PY) -m tests.shadow.pressure --steps 120 --pace 0.05 --json results/shadow_pressure.json || status=$$(( status ? status : 1 )); \
	$(PY) -m tests.reliability.report $(RELIABILITY_ROWS) --out docs/reliability.md --command "make soak" \
	  || status=$$(( status ? status : 1 )); exit $$status

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(BUILD) .pytest_cache .mypy_cache .ruff_cache
