"""The one training loop (`hstu.trainer`) seen through both backends: what a user sees is the
same whichever `--backend` runs it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hstu import backends
from hstu.cli import main
from hstu.config import load_config
from hstu.data import source_from_config
from hstu.errors import HSTUError
from hstu.metrics import STEP_FIELDS, read_rows

BACKENDS = ("torch", "jax")


def _available(name: str, *marks):
    ok, why = backends.available(name)
    return pytest.param(name, marks=[pytest.mark.skipif(not ok, reason=why), *marks])


PARAMS = [_available(b) for b in BACKENDS]


def _cli(backend: str, out, *overrides: str) -> int:
    return main(
        [
            "train",
            "--backend",
            backend,
            "--config",
            "demo",
            "dist.world_size=1",
            "data.batch_size=16",
            "train.log_every=1",
            f"output_dir={out}",
            *overrides,
        ]
    )


def _steps(out) -> list[int]:
    return [r["step"] for r in read_rows(out / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("backend", PARAMS)
def test_checkpoints_resume_and_metrics_file_behave_alike(backend, tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(backend, out, "train.steps=5", "train.checkpoint_every=2") == 0
    printed = capsys.readouterr().out
    # every multiple of checkpoint_every and the last step; the newest keep_checkpoints kept
    for step in (2, 4, 5):
        assert f"checkpoint: saved {out / 'checkpoints' / f'step-{step}'}" in printed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-5"]
    assert "world_size: 1" in printed and (out / "config.yaml").is_file()

    assert _cli(backend, out, "train.steps=7", "train.resume=true") == 0
    printed = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoints' / 'step-5'} (next sample 80)" in printed
    assert _steps(out) == list(range(7))  # the old lines kept, each step once

    # resuming from step-5 again re-trains step 5: its old line is replaced, not repeated
    assert _cli(backend, out, "train.steps=6", "train.resume=true") == 0
    assert _steps(out) == list(range(6))
    assert _cli(backend, out, "train.steps=3") == 0  # a fresh run starts the file over
    assert _steps(out) == [0, 1, 2]
    assert list((out / "tb").glob("events.out.tfevents.*"))


def test_both_backends_write_the_same_metric_fields(tmp_path):
    rows = {}
    for backend in BACKENDS:
        ok, why = backends.available(backend)
        if not ok:
            pytest.skip(why)
        assert _cli(backend, tmp_path / backend, "train.steps=2") == 0
        rows[backend] = read_rows(tmp_path / backend / "metrics.jsonl")
    keys = {b: set(r[0]) for b, r in rows.items()}
    assert keys["torch"] == keys["jax"], keys["torch"] ^ keys["jax"]
    assert set(STEP_FIELDS) | {"max_memory_gib"} <= keys["torch"]
    for b, r in rows.items():
        assert r[0]["max_memory_gib"] is None  # CPU: the device reports no peak memory
        assert np.isfinite(r[0]["grad_norm"]) and r[0]["grad_norm"] > 0, b
    for a, b in zip(rows["torch"], rows["jax"], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


@pytest.mark.parametrize(
    "backend",
    [_available("torch"), _available("jax", pytest.mark.slow)],  # jax: ~13 s
)
def test_metrics_fetched_two_steps_late_train_the_same_run(backend, tmp_path):
    """`train.metrics_lag=2` changes when the host reads a step's metrics, not what it trains
    or records: the same rows (each marked with its lag), the same checkpoints."""
    rows = {}
    for lag in (1, 2):
        out = tmp_path / f"lag{lag}"
        argv = ["train.steps=4", "train.checkpoint_every=2", f"train.metrics_lag={lag}"]
        assert _cli(backend, out, *argv) == 0
        rows[lag] = read_rows(out / "metrics.jsonl")
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert [r["step"] for r in rows[2]] == [0, 1, 2, 3]
    assert {r["fetch_lag"] for r in rows[1]} == {1} and {r["fetch_lag"] for r in rows[2]} == {2}
    for a, b in zip(rows[1], rows[2], strict=True):
        assert (a["loss"], a["grad_norm"], a["global_tokens"]) == (
            b["loss"],
            b["grad_norm"],
            b["global_tokens"],
        )


@pytest.mark.parametrize("lag", ["0", "4", "1.5"])
def test_a_metrics_lag_outside_one_to_three_is_refused(lag):
    with pytest.raises(HSTUError, match="train.metrics_lag"):
        load_config("demo", [f"train.metrics_lag={lag}"])


class _Tampered:
    """The demo samples with one sample altered (a user's data, as a SampleSource)."""

    def __init__(self, cfg, index: int, key: str, change):
        self.inner, self.index, self.key, self.change = source_from_config(cfg), index, key, change
        self.num_samples, self.jagged_keys = 0, self.inner.jagged_keys

    def sample(self, i: int) -> dict:
        s = self.inner.sample(i)
        if i == self.index:
            s[self.key] = self.change(np.asarray(s[self.key]))
        return s


def _with_last(value):
    return lambda a: np.concatenate([a[:-1], [value]])


@pytest.mark.parametrize("backend", PARAMS)
@pytest.mark.parametrize(
    "key, change, message",
    [
        ("item", _with_last(2000), r"values\['item'\] must lie in \[0, 2000\)"),
        ("candidate", _with_last(-1), r"values\['candidate'\] must lie in \[0, 2000\)"),
        ("contextual", lambda a: np.full(300, 1), "over the configured maximum 134"),
    ],
)
def test_bad_samples_fail_on_the_host_before_any_collective(
    backend, key, change, message, tmp_path
):
    cfg = load_config("demo", ["dist.world_size=1", "train.steps=2", f"output_dir={tmp_path}"])
    with pytest.raises(HSTUError, match=f"rank 0: .*{message}|rank 0.*{message}"):
        backends.get_train(backend)(cfg, source=_Tampered(cfg, 11, key, change))


@pytest.mark.parametrize("backend", PARAMS)
def test_resume_with_nothing_to_resume_starts_at_step_zero(backend, tmp_path, capsys):
    assert _cli(backend, tmp_path, "train.steps=1", "train.resume=true") == 0
    assert "train.resume: no checkpoint under" in capsys.readouterr().out
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 0


# jax's run (~12 s of compiling three programs) is in the slow tier; torch's holds the logic here
@pytest.mark.parametrize("backend", [_available("torch"), _available("jax", pytest.mark.slow)])
def test_a_packed_run_resumes_and_refuses_a_changed_packing_inside_a_window(
    backend, tmp_path, capsys
):
    # batch 16 in windows of 64 samples: step-2 saves next sample 32, inside the first window
    out = tmp_path / "run"
    packed = "data.pack_window=64"
    assert _cli(backend, out, "train.steps=2", "train.checkpoint_every=2", packed) == 0
    saved = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert saved["padding_waste"] >= 0
    assert _cli(backend, out, "train.steps=3", "train.resume=true", packed) == 0
    assert "(next sample 32)" in capsys.readouterr().out
    cfg = load_config(
        "demo",
        ["dist.world_size=1", "data.batch_size=16", "train.steps=4", "train.resume=true"]
        + [f"output_dir={out}", "data.pack_window=32"],
    )
    with pytest.raises(HSTUError, match="the data position 32 is inside a window of the saved"):
        backends.get_train(backend)(cfg)


PHASES = ("data_wait", "to_device", "stats_gather", "forward_backward", "exchange")
PHASES += ("optimizer_step", "fetch_wait", "checkpoint", "log")


def _profiled_torch(cfg, tmp_path):
    """Steps 1-3 of a one-rank CPU run under torch.profiler; the Chrome trace's path."""
    import torch
    import torch.distributed as dist

    from hstu.torch_backend.train_step import run_rank

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def hook(step, metrics):
        if step == 0:
            prof.start()
        elif step == 3:
            prof.stop()

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    try:
        run_rank(cfg, 0, 1, torch.device("cpu"), on_step=hook)
    finally:
        dist.destroy_process_group()
    path = str(tmp_path / "torch_trace.json")
    prof.export_chrome_trace(path)
    return path


def _profiled_jax(cfg, tmp_path, python: bool = True):
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = int(python)

    def hook(step, metrics):
        if step == 0:
            jax.profiler.start_trace(
                str(tmp_path / "jax"), create_perfetto_trace=True, profiler_options=options
            )
        elif step == 3:
            jax.profiler.stop_trace()

    backends.get_train("jax")(cfg, on_step=hook)
    return str(next((tmp_path / "jax").rglob("*.trace.json.gz")))


@pytest.mark.parametrize("backend", PARAMS)
def test_the_pipeline_phases_are_named_in_the_backends_profiler_trace(backend, tmp_path):
    """`scripts/profile_step.py` charges the device's idle gaps to these host ranges; both
    backends mark every phase on the one thread that dispatches the steps, once per step."""
    from hstu.bench import trace as tr

    cfg = load_config(
        "demo",
        ["dist.world_size=1", "data.batch_size=16", "train.steps=6", f"output_dir={tmp_path}"],
    )
    path = (_profiled_torch if backend == "torch" else _profiled_jax)(cfg, tmp_path)
    events = [e for e in tr.load(path) if e.get("ph") == "X"]
    marked = [e for e in events if str(e.get("name", "")).startswith(tr.PHASE_PREFIX)]
    assert {e["name"] for e in marked} == {tr.PHASE_PREFIX + p for p in PHASES}
    assert len({(e["pid"], e["tid"]) for e in marked}) == 1
    # the hook starts the trace when step 0's metrics arrive (step 1 dispatched), stops it at
    # step 3's: steps 2 and 3 are dispatched entirely inside it
    assert sum(e["name"] == "hstu.forward_backward" for e in marked) >= 2


@pytest.mark.parametrize("python", [True, False])
def test_a_jax_trace_without_python_calls_keeps_the_phases(python, tmp_path):
    """`scripts/profile_step.py --no-python-trace`: the Python tracer's calls (named
    `$file:line function`) leave the trace, whose overhead would read as device idle; the
    pipeline's phases, which the idle is charged to, stay."""
    pytest.importorskip("jax")
    from hstu.bench import trace as tr

    cfg = load_config(
        "demo",
        ["dist.world_size=1", "data.batch_size=16", "train.steps=6", f"output_dir={tmp_path}"],
    )
    events = [e for e in tr.load(_profiled_jax(cfg, tmp_path, python)) if e.get("ph") == "X"]
    names = {str(e.get("name", "")) for e in events}
    assert {n for n in names if n.startswith(tr.PHASE_PREFIX)} == {
        tr.PHASE_PREFIX + p for p in PHASES
    }
    assert any(n.startswith("$") for n in names) == python


# the workers build batches in backend-neutral code (hstu/data): torch's run in `make test`,
# jax's (~14 s on 2 cores) in the slow tier
@pytest.mark.parametrize("backend", [_available("torch"), _available("jax", pytest.mark.slow)])
def test_worker_processes_train_on_the_same_batches(backend, tmp_path):
    """`data.workers=2`: the batches come from spawned processes, the run is the same."""
    losses = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        assert _cli(backend, out, "train.steps=3", f"data.workers={workers}") == 0
        losses[workers] = [
            (r["loss"], r["global_tokens"]) for r in read_rows(out / "metrics.jsonl")
        ]
    assert losses[2] == losses[0]
