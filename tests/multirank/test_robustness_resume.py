"""Issue 16, cases 5, 8 and 9: a rank or process killed mid-run ends the others within seconds
with a message naming it; the run then resumes from its newest complete checkpoint on another
world size (torch 4 -> 2; jax 4 -> 2 and 4 -> 8) with no sample skipped or repeated; what the
kill (or a kill during checkpoint clean-up) left in the checkpoint folder is swept away.

The global batch is kept at 8 samples across world sizes (data.batch_size 2 on 4 ranks, 4 on
2, 1 on 8), so both resumed runs train the very same batches and must agree on the loss (the
loss is normalised by the global target count, whatever the split).
"""

from __future__ import annotations

import os
import shutil

import pytest

from hstu.config import load_config
from hstu.testing import DEMO_CONFIG

pytestmark = pytest.mark.multirank
GLOBAL_BATCH = 8
SMALL = ["model.num_layers=1", "train.log_every=100", "train.tensorboard=false"]
KILL_AT = 10 * GLOBAL_BATCH + 5  # batch 10 (samples 80..87 on 4 ranks of 2): rank 2 reads it


def _overrides(world: int, steps: int, out, *extra: str) -> list[str]:
    batch = GLOBAL_BATCH // world
    return [
        *(f"dist.world_size={world}", f"data.batch_size={batch}", f"train.steps={steps}"),
        *(*SMALL, f"output_dir={out}", *extra),
    ]


def _uninterrupted_ids(first: int, last: int) -> list[int]:
    """Sample ids an uninterrupted 4-rank run trains, in its order, from `first` to `last`."""
    from hstu.data import DataLoader, source_from_config

    cfg = load_config(DEMO_CONFIG, _overrides(4, 1, "unused"))
    loader = DataLoader(source_from_config(cfg), 2, 4, range(4))
    ids = []
    while len(ids) < last:
        ids += [int(i) for b in next(loader) for i in b.dense["sample_id"][: b.actual_batch_size]]
    return ids[first:last]


def _leave_debris(root, step: int, orbax: bool) -> None:
    """What a kill during a save or during clean-up leaves behind."""
    name = f"step-{step}.orbax-checkpoint-tmp-1234" if orbax else f"step-{step}"
    (root / name).mkdir()
    (root / name / "half-written").write_text("x")
    (root / "trash" / "step-1-0badc0de").mkdir(parents=True)


def _check_resumed(resumed: dict, logs: dict, step: int, kept: list[str], roots: dict) -> None:
    """Every resumed run: the samples right after the checkpoint, each once, the same losses
    (2 and 8 ranks); only the complete checkpoints left in the folder."""
    import robustness_workers as rw

    position = step * GLOBAL_BATCH
    want = _uninterrupted_ids(position, position + 2 * GLOBAL_BATCH)
    for world, rows in resumed.items():
        assert rows["steps"] == [step, step + 1], (world, rows)
        ids = [sample_id for _, sample_id in rw.recorded(logs[world])]
        assert sorted(ids) == want and len(set(ids)) == len(ids), (world, sorted(ids), want)
        assert sorted(os.listdir(roots[world])) == kept, world
    if len(resumed) > 1:
        assert resumed[2]["losses"] == pytest.approx(resumed[8]["losses"], rel=2e-5)


def _resume_on(worlds, train, root_a, tmp_path, orbax: bool) -> tuple:

    complete = sorted(p.name for p in root_a.iterdir() if p.name.startswith("step-"))
    complete = [n for n in complete if n[5:].isdigit() and _is_complete(root_a / n, orbax)]
    step = max(int(n[5:]) for n in complete)
    assert step >= 2, complete
    resumed, logs, roots = {}, {}, {}
    for world in worlds:
        out = tmp_path / f"resumed-{world}"
        roots[world] = out / "checkpoints"
        shutil.copytree(root_a, roots[world])
        _leave_debris(roots[world], step + 50, orbax)
        logs[world] = tmp_path / f"reads-{world}"
        logs[world].mkdir()
        overrides = _overrides(world, step + 2, out, "train.resume=true")
        resumed[world] = train(world, overrides, {"kind": "record", "log_dir": str(logs[world])})
    return step, resumed, logs, roots, sorted(complete)


def _is_complete(folder, orbax: bool) -> bool:
    return orbax or (folder / "COMPLETE").is_file()


@pytest.mark.slow  # ~14 s: `make test-slow`
def test_torch_rank_killed_then_resumed_on_2_ranks(tmp_path):
    pytest.importorskip("torchrec")
    import time

    import robustness_workers as rw

    from hstu.errors import HSTUError
    from hstu.torch_backend.launch import train

    cfg = load_config(DEMO_CONFIG, _overrides(4, 14, tmp_path / "a", "train.checkpoint_every=2"))
    source = rw.RecordingSource(cfg.to_dict(), str(tmp_path), kill_at=KILL_AT)
    start = time.time()
    with pytest.raises(HSTUError, match=r"^rank 2 \(pid \d+\) died: killed by SIGKILL"):
        train(cfg, source=source)
    assert time.time() - start < 60

    def resume(world, overrides, spec):
        c = load_config(DEMO_CONFIG, overrides)
        rows = train(c, source=rw.make_source(c, spec))
        return {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows]}

    step, resumed, logs, roots, kept = _resume_on(
        (2,), resume, tmp_path / "a" / "checkpoints", tmp_path, orbax=False
    )
    _check_resumed(resumed, logs, step, kept, roots)


@pytest.mark.slow  # ~19 s on 2 cores; CI runs the slow tier after `make test`
def test_jax_process_killed_then_resumed_on_2_and_8_devices(tmp_path):
    pytest.importorskip("jax")
    import robustness_workers as rw

    procs = rw.start_jax_processes(
        _overrides(4, 14, tmp_path / "a", "train.checkpoint_every=2"),
        {"kind": "record", "log_dir": str(tmp_path), "kill_at": KILL_AT},  # on process 1
    )
    survivor, killed = rw.finish_all(procs, timeout=180)
    assert killed["code"] == -9, killed["stderr"][-3000:]
    assert survivor["code"] not in (0, None), survivor["stderr"][-3000:]
    assert survivor["ended"] - killed["ended"] < 30
    named = "hstu: error: process(es) [1] stopped" in survivor["stderr"] or (
        "stopped sending heartbeats):\n1\n" in survivor["stderr"]  # died before a collective
    )
    assert named, survivor["stderr"][-3000:]

    def resume(world, overrides, spec):
        out = rw.run("jax", overrides, spec, devices=world, timeout=180)
        assert out["code"] == 0, out["stderr"][-3000:]
        return out["result"]

    step, resumed, logs, roots, kept = _resume_on(
        (2, 8), resume, tmp_path / "a" / "checkpoints", tmp_path, orbax=True
    )
    _check_resumed(resumed, logs, step, kept, roots)
