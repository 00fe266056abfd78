"""Shared fixtures. GPU-marked tests skip on machines without CUDA, with that reason."""

from __future__ import annotations

import numpy as np
import pytest

from hstu.config import load_config
from hstu.testing import DEMO_CONFIG


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
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
