"""Checks the launcher makes before any rank starts."""

import subprocess
import sys
import time

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_benchmark_run_dies_with_the_benchmark(tmp_path):
    """`child_env` + `die_with_env_parent`: the child arms the parent-death signal itself (no
    code between fork and exec); when the parent exits, the child is killed at once."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import os, sys, time; from hstu.launch_checks import die_with_env_parent; "
        "die_with_env_parent(); assert 'HSTU_DIE_WITH_PARENT' not in os.environ; "
        "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; from hstu.launch_checks import child_env; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}, sys.argv[1]], env=child_env()); "
        "[time.sleep(0.05) for _ in range(400) if not __import__('os').path.exists(sys.argv[1])]"
    )
    subprocess.run([sys.executable, "-c", parent, str(pid_file)], check=True, timeout=60)
    pid = int(pid_file.read_text())  # the child was up when its parent exited
    deadline = time.time() + 10
    while time.time() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the child outlived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
