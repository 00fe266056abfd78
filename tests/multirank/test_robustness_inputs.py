"""Issue 16, cases 4 and 7: bad input is a clear error, raised where it is cheapest.

* `output_dir` that is a file, cannot be created or is not writable, and a `dist.world_size`
  the machine cannot run: an error from the launching process before any rank starts (no
  process spawned, no JAX device configured);
* timestamps in fractional seconds: an error naming the sample, the key and the rank (the
  batch is built in int64 and would silently truncate them), in both backends;
* epoch-millisecond timestamps: torch computes them (int64); JAX carries timestamps in int32,
  so it trains on them when no time bias reads them and names sample, key and rank when one
  does.
"""

from __future__ import annotations

import os

import pytest

from hstu import backends
from hstu.cli import main

pytestmark = pytest.mark.multirank
BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(not backends.available(b)[0], reason=b))
    for b in ("torch", "jax")
]


def _no_rank_may_start(monkeypatch, backend: str) -> None:
    if backend == "torch":
        import torch.multiprocessing as mp

        def spawn(*args, **kwargs):
            raise AssertionError("a rank was spawned")

        monkeypatch.setattr(mp, "start_processes", spawn)
    else:
        import hstu.jax_backend.launch as launch

        def devices(*args, **kwargs):
            raise AssertionError("JAX devices were configured")

        monkeypatch.setattr(launch, "select_devices", devices)


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_dir_and_world_size_errors_come_before_any_rank(
    backend, tmp_path, monkeypatch, capsys
):
    _no_rank_may_start(monkeypatch, backend)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        f"output_dir={a_file}": "is a file, not a directory",
        f"output_dir={a_file / 'run'}": "cannot be created",
        "dist.world_size=1000000": "dist.world_size=1000000 is more than this machine can run",
    }
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases[f"output_dir={locked}"] = "is not writable"
    for override, message in cases.items():
        argv = ["train", "--backend", backend, "--config", "demo", override]
        if override.startswith("dist."):
            argv.append(f"output_dir={tmp_path / 'run'}")
        assert main(argv) == 2, override
        assert message in capsys.readouterr().err, override


def test_torch_rejects_fractional_timestamps_and_computes_milliseconds(tmp_path):
    pytest.importorskip("torchrec")
    import robustness_workers as rw

    from hstu.config import load_config
    from hstu.errors import HSTUError
    from hstu.testing import DEMO_CONFIG
    from hstu.torch_backend.launch import train

    cfg = load_config(
        DEMO_CONFIG,
        [
            *("dist.world_size=1", "train.steps=2", "model.num_layers=1"),
            *("model.rab_time_buckets=8", "train.tensorboard=false", f"output_dir={tmp_path}"),
        ],
    )
    fraction = rw.ShiftedTime(cfg.to_dict(), 0.5, index=9)
    with pytest.raises(HSTUError, match=r"invalid sample 9 \(read for rank 0\): values\['item_ti"):
        train(cfg, source=fraction)
    assert len(train(cfg, source=rw.ShiftedTime(cfg.to_dict(), 1_700_000_000_000))) == 2


def test_jax_names_fractional_and_out_of_range_timestamps(tmp_path):
    pytest.importorskip("jax")
    import robustness_workers as rw

    out = rw.run("jax_inputs", [str(tmp_path)], timeout=240)
    assert out["code"] == 0, out["stderr"][-3000:]
    got = out["result"]
    # sample 9 of a global batch of 4 ranks x 4 is rank 2's
    assert got["fraction"].startswith("invalid sample 9 (read for rank 2): values['item_time']")
    assert "must be integers" in got["fraction"]
    assert got["millis_unused"] == "ok 2 steps"
    assert got["millis_used"].startswith("invalid sample 0 (read for rank 0): values['item_time']")
    assert "beyond int32" in got["millis_used"] and "rab_time_buckets" in got["millis_used"]
