"""`hstu convert`: a checkpoint written by one backend resumes training in the other.

Backend A trains 10 demo steps and checkpoints; the checkpoint is converted (parameters, AdamW
moments and step count, data position); backend B resumes it for steps 10..29, which must
match A's uninterrupted 30-step run (rel 1e-4). Converting back gives A's checkpoint exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchrec")
pytest.importorskip("jax")

from parity_workers import demo_overrides, jax_test_env  # noqa: E402

from hstu.cli import main  # noqa: E402
from hstu.config import load_config  # noqa: E402
from hstu.parity import FP32_ENV, rel_diff, run_backend  # noqa: E402
from hstu.testing import DEMO_CONFIG  # noqa: E402

FIRST = 10
AFTER = 8  # steps the converted checkpoint trains on (its curve is the source's from FIRST)
RTOL = 1e-4


def _read(backend: str, path, cfg):
    from hstu.convert import backend_convert

    return backend_convert(backend).read_portable(path, cfg)


def _assert_same_state(a, b) -> None:
    assert (a.step, a.data, a.adam.count) == (b.step, b.data, b.adam.count)
    for got, want in ((a.params, b.params), (a.adam.mu, b.adam.mu), (a.adam.nu, b.adam.nu)):
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize(("src", "dst"), [("torch", "jax"), ("jax", "torch")])
def test_converted_checkpoint_continues_the_source_curve(demo_runs, tmp_path, src, dst):
    env = {**FP32_ENV, **jax_test_env()}
    first, resumed = tmp_path / f"{src}-first", tmp_path / f"{dst}-resumed"
    checkpointing = [f"train.checkpoint_every={FIRST}"]
    run_backend(src, DEMO_CONFIG, demo_overrides(steps=FIRST) + checkpointing, first, env)

    assert main(["convert", "--from", src, "--to", dst, str(first), str(resumed)]) == 0
    assert (resumed / "checkpoints" / f"step-{FIRST}").is_dir()
    resume = demo_overrides(steps=FIRST + AFTER) + ["train.resume=true"]
    rows = run_backend(dst, DEMO_CONFIG, resume, resumed, env)

    assert [r["step"] for r in rows] == list(range(FIRST, FIRST + AFTER))
    uninterrupted = demo_runs.rows(src)[FIRST : FIRST + AFTER]
    for got, want in zip(rows, uninterrupted, strict=True):
        assert rel_diff(got["loss"], want["loss"]) <= RTOL, (got["step"], got["loss"], want)
        assert got["global_tokens"] == want["global_tokens"]  # the same data position

    # and back: the round trip reproduces the source checkpoint bit for bit
    back = tmp_path / f"{src}-back"
    assert main(["convert", "--from", dst, "--to", src, str(resumed), str(back)]) == 0
    cfg = load_config(first / "config.yaml")
    original = _read(src, first, cfg)
    assert original.step == FIRST and original.adam.count == FIRST
    assert original.data == {"next_sample": FIRST * cfg.data.batch_size * cfg.dist.world_size}
    _assert_same_state(_read(src, back, cfg), original)


def test_parameter_files_convert_both_ways_exactly(tmp_path):
    import torch

    from hstu.params import init_params
    from hstu.torch_backend.model import HSTUModel

    cfg = load_config(DEMO_CONFIG, ["model.rab_time_buckets=4"])
    cfg.save(tmp_path / "config.yaml")  # found above SRC: no --config needed
    params = init_params(cfg.model, 7)
    model = HSTUModel(cfg.model)
    model.load_params(params)
    torch.save(model.state_dict(), tmp_path / "model.pt")

    assert (
        main(
            [
                "convert",
                "--from",
                "torch",
                "--to",
                "jax",
                *_paths(tmp_path, "model.pt", "p.msgpack"),
            ]
        )
        == 0
    )
    assert (
        main(
            ["convert", "--from", "jax", "--to", "torch", *_paths(tmp_path, "p.msgpack", "back.pt")]
        )
        == 0
    )
    from_jax = _read("jax", tmp_path / "p.msgpack", cfg).params
    assert set(from_jax) == set(params)
    for name, value in params.items():
        np.testing.assert_array_equal(from_jax[name], value, err_msg=name)
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(back[name], value), name


def _paths(root, *names: str) -> list[str]:
    return [str(root / n) for n in names]


def test_conversion_errors_name_the_problem(tmp_path, capsys):
    import torch

    from hstu.params import init_params
    from hstu.torch_backend.model import HSTUModel

    cfg = load_config(DEMO_CONFIG)
    model = HSTUModel(cfg.model)
    model.load_params(init_params(cfg.model, 0))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    demo = ["--config", str(DEMO_CONFIG)]
    cases = [
        (["torch", "jax", "model.pt", "run", *demo], "parameters only"),
        (["torch", "jax", "model.pt", "p.pt", *demo], "ends with .msgpack"),
        (["torch", "jax", "model.pt", "p.msgpack", *demo, "model.num_layers=1"], "layers.1"),
        (["torch", "jax", "missing", "run", *demo], "does not exist"),
        (["torch", "jax", "model.pt", "p.msgpack"], "no --config given"),
        (["jax", "torch", "model.pt", "run", *demo], "ends with .msgpack"),
        (["jax", "torch", "empty", "run", *demo], "no complete step-N"),
    ]
    (tmp_path / "empty").mkdir()
    for (src, dst, a, b, *rest), message in cases:
        argv = ["convert", "--from", src, "--to", dst, str(tmp_path / a), str(tmp_path / b)]
        assert main(argv + rest) == 2, message
        assert message in capsys.readouterr().err
