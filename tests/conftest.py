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


class LaunchSpy:
    """Stands in for a Triton kernel (`kernel[grid](...)`): records each launch's grid and
    keyword (meta) arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.meta = kernel, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.meta.append(kwargs)
            return launch(*args, **kwargs)

        return call


@pytest.fixture
def spy_launches(monkeypatch):
    """`spy(module, name)`: kernel `module.name` replaced, for the test, by a `LaunchSpy`."""

    def spy(module, name: str) -> LaunchSpy:
        found = LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, found)
        return found

    return spy


# The publisher-format sample the prepared-data tests train on: 600 users, 300 items, 5-40
# events each (13k events), enough that a one-layer model learns the planted walk in a few
# hundred steps. Numpy only; prepared once per session.
PREPARED_SPEC_ARGS = {"num_users": 600, "num_items": 300, "max_events": 40}


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory):
    """{"ml-1m": dir, "kuairand-pure": dir}: `hstu data prepare` outputs of generated files."""
    from hstu.data.prepare import prepare
    from hstu.testing_data import PlantedSpec, write_dataset

    root = tmp_path_factory.mktemp("prepared_data")
    out = {}
    for name in ("ml-1m", "kuairand-pure"):
        src = write_dataset(name, root / f"{name}-src", PlantedSpec(**PREPARED_SPEC_ARGS))
        prepare(name, src, root / name)
        out[name] = root / name
    return out


@pytest.fixture
def demo_cfg():
    return load_config(DEMO_CONFIG)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
