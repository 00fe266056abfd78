# Set-up and entry points. `make demo` and `make test` each create .venv/ at the repo root,
# install what is needed (idempotent: a stamp skips the installs when nothing changed) and run.
#
# The install order matters: torchrec declares a dependency on the CUDA `fbgemm-gpu` wheel,
# which would replace `fbgemm-gpu-cpu` under the same import name and then fail to load on a
# CPU machine. So fbgemm-gpu-cpu goes in first, torchrec with --no-deps, then its light deps.

PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.hstu-setup
PIP_FLAGS := --disable-pip-version-check --no-input --quiet

TORCH_PKGS := torch==2.13.0
FBGEMM_PKGS := fbgemm-gpu-cpu==1.8.0
TORCHREC_PKGS := torchrec==1.8.0
TORCHREC_DEPS := tensordict==0.15.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 \
	iopath==0.1.10 torchmetrics==1.9.0 lightning-utilities==0.15.3 tqdm==4.70.1
JAX_PKGS := jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8
OTHER_PKGS := triton==3.9.0 numpy pyyaml tqdm tensorboard matplotlib pytest hypothesis ruff \
	pytest-timeout

.PHONY: setup demo test test-fast test-slow test-mosaic has-mosaic-python lint format bench parity clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) --upgrade pip setuptools wheel
	$(PIP) install $(PIP_FLAGS) $(TORCH_PKGS)
	$(PIP) install $(PIP_FLAGS) $(FBGEMM_PKGS)
	$(PIP) install $(PIP_FLAGS) --no-deps $(TORCHREC_PKGS)
	$(PIP) install $(PIP_FLAGS) $(TORCHREC_DEPS)
	$(PIP) install $(PIP_FLAGS) $(JAX_PKGS) $(OTHER_PKGS)
	$(PIP) install $(PIP_FLAGS) --no-deps --no-build-isolation -e .
	$(VENV)/bin/python -c "import torch, torchrec, fbgemm_gpu, jax, flax, optax, orbax.checkpoint, triton, hstu, hstu_kernels"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hstu train --backend torch --config demo

test: setup
	$(VENV)/bin/python -m pytest -q -m "not slow"

# The end-to-end tests of more than ~10 s each (marked `slow`); CI runs them after `test`.
test-slow: setup
	$(VENV)/bin/python -m pytest -q -m slow

# The core's tests alone, with torch and jax blocked (they must not be needed): seconds.
test-fast: setup
	HSTU_BLOCK_BACKENDS=1 $(VENV)/bin/python -m pytest -q tests/core

# The Mosaic GPU attention forward is written for jax >= 0.11 (the GPU image's 0.11.2), which
# needs Python >= 3.12: its CPU tests (Mosaic GPU's interpreter, and the kernel lowered for
# CUDA) run in a second environment. The interpreter runs each warp group as a host thread
# blocked in XLA callbacks, hence 4 host devices' threads on a 2-core machine.
MOSAIC_PYTHON ?= $(firstword $(wildcard /usr/bin/python3.12 /usr/local/bin/python3.12 \
	$(HOME)/.pyenv/versions/3.12*/bin/python3.12))
MOSAIC_VENV := .venv-mosaic
MOSAIC_STAMP := $(MOSAIC_VENV)/.hstu-setup
MOSAIC_PKGS := jax==0.11.2 jaxlib==0.11.2 numpy pyyaml pytest pytest-timeout

$(MOSAIC_STAMP): pyproject.toml Makefile
	@test -n "$(MOSAIC_PYTHON)" || { echo "test-mosaic: no Python 3.12 found (set MOSAIC_PYTHON)"; exit 1; }
	test -x $(MOSAIC_VENV)/bin/python || $(MOSAIC_PYTHON) -m venv $(MOSAIC_VENV)
	$(MOSAIC_VENV)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip setuptools wheel
	$(MOSAIC_VENV)/bin/python -m pip install $(PIP_FLAGS) $(MOSAIC_PKGS)
	$(MOSAIC_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation -e .
	touch $(MOSAIC_STAMP)

has-mosaic-python:
	@test -n "$(MOSAIC_PYTHON)"

test-mosaic: $(MOSAIC_STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=4 \
		$(MOSAIC_VENV)/bin/python -m pytest -q tests/unit/test_pallas_mosaic.py \
		tests/unit/test_pallas_layer_norm.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(VENV)/bin/hstu bench balance

parity: setup
	$(VENV)/bin/hstu parity --config configs/demo.yaml

clean:
	rm -rf $(VENV) $(MOSAIC_VENV) runs .pytest_cache .ruff_cache
