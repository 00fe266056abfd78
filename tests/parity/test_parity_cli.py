"""`hstu parity`: the table, the exit code, tolerances and golden files, with the two training
runs replaced by recorded rows (the real runs are exercised by test_training_parity.py, which
trains through the same `hstu.parity.run_backend`)."""

from __future__ import annotations

import json

import pytest

from hstu import parity
from hstu.cli import main
from hstu.testing import DEMO_CONFIG


def _rows(losses, tokens_per_s=1000.0):
    return [{"step": i, "loss": v, "tokens_per_s": tokens_per_s} for i, v in enumerate(losses)]


@pytest.fixture
def fake_runs(monkeypatch):
    """Replace training by given curves; records each call's arguments."""
    curves, calls = {}, []

    def runner(backend, config, overrides, output_dir, env):
        calls.append({"backend": backend, "overrides": overrides, "out": output_dir, "env": env})
        return _rows(curves[backend], 2000.0 if backend == "jax" else 1000.0)

    monkeypatch.setattr(parity, "run_backend", runner)
    return curves, calls


def _parity(tmp_path, *extra: str) -> list[str]:
    return ["parity", "--config", str(DEMO_CONFIG), "--output-dir", str(tmp_path), *extra]


def test_agreeing_curves_pass_and_print_the_table(fake_runs, tmp_path, capsys):
    curves, calls = fake_runs
    curves |= {"torch": [1.5, 1.4, 1.3], "jax": [1.5, 1.40001, 1.3]}
    assert main(_parity(tmp_path, "train.steps=3")) == 0
    out = capsys.readouterr().out
    assert "loss torch" in out and "jax tok/s" in out and "PASS" in out
    assert "7.14e-06" in out  # rel diff of step 1: 1e-5 / 1.40001
    assert [c["backend"] for c in calls] == ["torch", "jax"]
    assert calls[0]["overrides"] == ["train.steps=3"] and calls[1]["out"] == tmp_path / "jax"
    assert calls[0]["env"]["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"  # fp32: no TF32


def test_disagreeing_curves_exit_nonzero(fake_runs, tmp_path, capsys):
    curves, _ = fake_runs
    curves |= {"torch": [1.5, 1.4], "jax": [1.5, 1.41]}
    assert main(_parity(tmp_path)) == 1
    assert "FAIL: largest relative loss difference 7.09e-03 (rtol 1e-04)" in capsys.readouterr().out
    assert main(_parity(tmp_path, "--rtol", "1e-2")) == 0


def test_bf16_default_tolerance_is_looser(fake_runs, tmp_path, capsys):
    curves, calls = fake_runs
    curves |= {"torch": [1.5, 1.4], "jax": [1.5, 1.41]}  # 7e-3: a couple of bf16 roundings
    assert main(_parity(tmp_path, "model.dtype=bfloat16")) == 0
    assert f"rtol {parity.DEFAULT_RTOL['bfloat16']:.0e}" in capsys.readouterr().out
    assert "JAX_DEFAULT_MATMUL_PRECISION" not in calls[0]["env"]


def test_golden_write_and_check(fake_runs, tmp_path, capsys):
    curves, _ = fake_runs
    golden = tmp_path / "golden.json"
    curves |= {"torch": [1.5, 1.4], "jax": [1.5, 1.40002]}
    assert main(_parity(tmp_path, "train.steps=2", "--write-golden", str(golden))) == 0
    data = json.loads(golden.read_text())
    assert data["losses"] == pytest.approx([1.5, 1.40001]) and data["overrides"] == [
        "train.steps=2"
    ]
    assert data["command"].endswith(f"--write-golden {golden}")
    assert main(_parity(tmp_path, "train.steps=2", "--golden", str(golden))) == 0

    curves |= {"torch": [1.5, 1.45], "jax": [1.5, 1.45]}  # both drift the same way
    capsys.readouterr()
    assert main(_parity(tmp_path, "--golden", str(golden))) == 1
    out = capsys.readouterr().out
    assert "FAIL: torch vs golden" in out and "at step 1" in out

    curves |= {"torch": [1.5, 1.4], "jax": [1.5, 1.5]}  # no golden file from disagreeing runs
    assert main(_parity(tmp_path, "--write-golden", str(tmp_path / "bad.json"))) == 2
    assert "no golden file written" in capsys.readouterr().err


def test_mismatched_runs_are_an_error(fake_runs, tmp_path, capsys):
    curves, _ = fake_runs
    curves |= {"torch": [1.5, 1.4, 1.3], "jax": [1.5, 1.4]}
    assert main(_parity(tmp_path)) == 2
    assert "different steps" in capsys.readouterr().err
    assert main(_parity(tmp_path, "train.stepz=3")) == 2  # checked before training
    assert "unknown key 'train.stepz'" in capsys.readouterr().err
