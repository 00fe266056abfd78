"""Shared fixtures of the parity suite: demo-recipe training runs of both backends, each run
once per session however many tests read it (every run costs ~10 s on 2 CPU cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The torch rank launcher of the multi-rank tests (gloo processes), reused here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))

from parity_workers import DemoRuns  # noqa: E402


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory) -> DemoRuns:
    return DemoRuns(tmp_path_factory.mktemp("demo-runs"))
