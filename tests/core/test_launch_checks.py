"""Checks the launcher makes before any rank starts."""

import pytest

from hstu.config import load_config
from hstu.errors import HSTUError
from hstu.launch_checks import preflight


def test_a_fresh_run_refuses_a_directory_with_another_runs_checkpoints(tmp_path):
    (tmp_path / "checkpoints" / "step-40").mkdir(parents=True)
    fresh = load_config("demo", [f"output_dir={tmp_path}", "train.checkpoint_every=10"])
    with pytest.raises(HSTUError, match=r"holds checkpoints of an earlier run \(\['step-40'\]\)"):
        preflight(fresh, "torch")
    assert (tmp_path / "checkpoints" / "step-40").is_dir()  # nothing was deleted
    # resuming it, or a run that writes no checkpoints, is fine
    preflight(load_config("demo", [f"output_dir={tmp_path}", "train.resume=true"]), "jax")
    preflight(load_config("demo", [f"output_dir={tmp_path}"]), "jax")
