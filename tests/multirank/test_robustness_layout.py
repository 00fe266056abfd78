"""Issue 16, case 3: a rank whose batch layout differs from the others' (a jagged key missing,
extra or reordered, a value or dense dtype, a dense field, the batch size) is named, with the
field, on EVERY rank right after the stats gather, which still succeeds (the gathered width is
fixed) and stays usable: no rank hangs, no raw KeyError / gloo size error.

Torch: 4 gloo ranks (NCCL on the GPU machine); JAX: 4 host devices in one process, and 2
processes x 2 devices through jax.distributed via the trainer.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multirank


def _check_every_rank_names_the_odd_one(
    per_rank: list[dict], world: int = 4, odd: int = 2, read_all: bool = False
) -> None:
    """`per_rank`: each process's errors by case (`read_all`: one process read every batch)."""
    from robustness_workers import LAYOUT_CASES

    agree = [r for r in range(world) if r != odd]
    for rank, out in enumerate(per_rank):
        for case, (_, field) in LAYOUT_CASES.items():
            message = out[case]
            assert message.startswith(f"batch layout differs across ranks: rank {odd} has"), message
            assert f"ranks {agree} agree" in message, message
            if read_all or rank == odd or case not in ("extra", "dense_extra"):
                assert field in message, (rank, case, message)
            else:  # only rank 2 ever read that name: the others say so
                assert "this process never read" in message, (rank, case, message)
        assert out["None"].startswith("ok"), out["None"]  # the group survived every error


def test_torch_ranks_all_name_the_odd_rank_and_field():
    pytest.importorskip("torchrec")
    from robustness_workers import torch_layout_worker
    from torch_workers import run_on_ranks

    _check_every_rank_names_the_odd_one(run_on_ranks(torch_layout_worker, 4))


@pytest.mark.gpu
def test_nccl_ranks_all_name_the_odd_rank_and_field():
    import torch
    from robustness_workers import torch_layout_worker
    from torch_workers import run_on_ranks

    world = min(4, torch.cuda.device_count())
    if world < 2:
        pytest.skip("needs 2 GPUs")
    odd = min(2, world - 1)  # two ranks: rank 0's side wins the tie
    out = run_on_ranks(torch_layout_worker, world, odd, device="cuda")
    _check_every_rank_names_the_odd_one(out, world, odd)


def test_jax_single_process_names_the_odd_rank_and_field():
    pytest.importorskip("jax")
    import robustness_workers as rw

    out = rw.run("jax_layout", [], timeout=240)
    assert out["code"] == 0, out["stderr"][-3000:]
    _check_every_rank_names_the_odd_one([out["result"]], read_all=True)
    assert "rank 2 has batch_size 5 instead of 4" in out["result"]["batch_size"]


def test_jax_processes_both_fail_fast_naming_the_odd_ranks(tmp_path):
    """Process 1 (ranks 2, 3) reads one jagged key more: both processes stop at the first
    stats gather with the same message, in seconds."""
    pytest.importorskip("jax")
    import robustness_workers as rw

    overrides = ["dist.world_size=4", "model.num_layers=1", "train.steps=4"]
    procs = rw.start_jax_processes(
        [*overrides, f"output_dir={tmp_path}"], {"kind": "extra_key", "process": 1}
    )
    outs = [rw.finish(p, timeout=120) for p in procs]
    for pid, out in enumerate(outs):
        # 2: this process raised it; 1: the other's report reached it first (same message)
        assert out["code"] in (1, 2), (pid, out["stderr"][-3000:])
        assert out["seconds"] < 60, out["seconds"]
        assert "batch layout differs across ranks: rank 2 has extra jagged key" in out["stderr"]
        assert "also rank 3 has" in out["stderr"] and "ranks [0, 1] agree" in out["stderr"]


def test_jax_processes_started_with_different_configs_stop_at_once(tmp_path):
    """A batch size is a config: processes that disagree (rows per rank differ, which no
    gather survives) are stopped at start-up, every one naming the key."""
    pytest.importorskip("jax")
    import robustness_workers as rw

    overrides = ["dist.world_size=4", "model.num_layers=1", f"output_dir={tmp_path}"]
    procs = rw.start_jax_processes(overrides, extra=[[], ["data.batch_size=3"]])
    for out in rw.finish_all(procs, timeout=120):
        assert out["code"] in (1, 2), out["stderr"][-3000:]  # 1: the other one said it first
        assert "started with different configs" in out["stderr"]
        assert "data.batch_size=" in out["stderr"] and out["ended"] < 60
