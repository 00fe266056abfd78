"""Shared fixtures. GPU-marked tests skip on machines without CUDA, with that reason."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in the interpreter. The flag must be set before triton is
# first imported, and torchrec / torch._dynamo import it early, so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hstu.config import load_config  # noqa: E402
from hstu.testing import DEMO_CONFIG  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
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
