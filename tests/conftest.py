"""Shared fixtures. Imports neither torch nor jax, so the core tier (tests/core) runs with
neither installed; `HSTU_BLOCK_BACKENDS=1` (what `make test-fast` sets) makes importing any
framework an error, which proves it.

GPU-marked tests skip on machines without an NVIDIA device, with that reason; there, the
Triton kernels run in the interpreter (the flag must be set before triton is first imported).
"""

from __future__ import annotations

import os

from hstu.testing import block_backends, has_nvidia_gpu

if os.environ.get("HSTU_BLOCK_BACKENDS"):
    block_backends()

if not has_nvidia_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hstu.config import load_config  # noqa: E402
from hstu.testing import DEMO_CONFIG  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if has_nvidia_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def demo_cfg():
    return load_config(DEMO_CONFIG)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
