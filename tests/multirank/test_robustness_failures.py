"""Issue 16, cases 1, 6 and the watchdog: whatever fails, every process of the run ends soon,
with a message that names what failed.

* a bad batch in one JAX process of two: both end in seconds (was: ~5 minutes in the shutdown
  barrier and a collective), the healthy one with the failing rank's message;
* the torch launcher killed while SIGINT is ignored (`hstu train ... &` in a script): its ranks
  die with it instead of training on;
* a rank that makes no progress (a data read that never returns): the watchdog prints every
  thread's stack and ends the run.

Killed ranks and processes (case 8) are in test_robustness_resume.py, which resumes from them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank
SMALL = [
    "model.num_layers=1",
    "data.batch_size=4",
    "train.log_every=100",
    "train.tensorboard=false",
]


@pytest.mark.slow  # ~12 s: two jax processes start and compile
def test_jax_bad_batch_in_one_process_ends_both_in_seconds(tmp_path):
    pytest.importorskip("jax")
    import robustness_workers as rw

    # global batch 2 holds samples 32..47, 4 per rank: sample 45 is rank 3's, on process 1
    bad = {"kind": "changed", "index": 45, "key": "item", "value": 5000, "action": "last"}
    procs = rw.start_jax_processes(
        ["dist.world_size=4", "train.steps=6", *SMALL, f"output_dir={tmp_path}"], bad
    )
    failed, healthy = [rw.finish(p, timeout=120) for p in procs][::-1]
    why = "invalid batch on rank 3: values['item'] must lie in [0, 2000)"
    assert failed["code"] == 2 and f"hstu: error: {why}" in failed["stderr"], failed["stderr"]
    assert healthy["code"] == 1, healthy["stderr"][-3000:]
    assert f"process 1 failed, so process 0 stops too: (process 1) {why}" in healthy["stderr"]
    assert healthy["seconds"] < 60 and abs(healthy["seconds"] - failed["seconds"]) < 10


def _rank_pids(launcher: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return [p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:  # a zombie has ended; its new parent reaps it
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # ~11 s: a torchrun launcher and its ranks start
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_torch_ranks_die_with_their_launcher_even_with_sigint_ignored(tmp_path):
    pytest.importorskip("torchrec")
    cmd = [
        *(sys.executable, "-m", "hstu.cli", "train", "--backend", "torch", "--config", "demo"),
        *("dist.world_size=2", "train.steps=100000", *SMALL, f"output_dir={tmp_path}"),
    ]
    launcher = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # `cmd &` in a script
    )
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 120
        while not (metrics.is_file() and metrics.read_text()):  # the ranks are training
            assert launcher.poll() is None and time.time() < deadline
            time.sleep(0.2)
        ranks = _rank_pids(launcher.pid)
        assert len(ranks) == 2
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 10
    while any(_alive(p) for p in ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), "ranks outlived their launcher"


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_watchdog_dumps_every_stack_and_ends_a_stalled_run(backend, tmp_path):
    pytest.importorskip("torchrec" if backend == "torch" else "jax")
    import robustness_workers as rw

    hang = {"kind": "changed", "index": 9, "action": "hang"}  # batch 2's data never arrives
    out = rw.run(
        backend,
        [
            "dist.world_size=1",
            "train.steps=5",
            "train.watchdog_s=2",
            *SMALL,
            f"output_dir={tmp_path}",
        ],
        hang,
        timeout=120,
    )
    assert out["code"] == 1, out["stderr"][-3000:]
    assert (
        "hstu: error: watchdog: no training step finished on rank(s) [0] for 2 s" in out["stderr"]
    )
    assert 'Thread "host-prefetch"' in out["stderr"] and "in changed" in out["stderr"]
    assert 'Thread "MainThread"' in out["stderr"]


@pytest.mark.gpu
def test_nccl_bad_batch_names_the_rank_and_ends_the_run(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import robustness_workers as rw

    from hstu.config import load_config
    from hstu.errors import HSTUError
    from hstu.testing import DEMO_CONFIG
    from hstu.torch_backend.launch import train

    cfg = load_config(
        DEMO_CONFIG,
        [
            "dist.world_size=2",
            "dist.device=cuda",
            "train.steps=6",
            *SMALL,
            f"output_dir={tmp_path}",
        ],
    )
    # global batch 2 holds samples 16..23, 4 per rank: sample 21 is rank 1's
    bad = rw.ChangedSample(cfg.to_dict(), 21, key="item", value=5000, action="last")
    start = time.time()
    with pytest.raises(HSTUError, match=r"invalid batch on rank 1: values\['item'\] must lie"):
        train(cfg, source=bad)
    assert time.time() - start < 120
