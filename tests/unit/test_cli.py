import subprocess
import sys

from hstu.cli import main


def test_help_lists_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "bench" in out


def test_bad_override_is_a_clear_error(capsys):
    assert main(["train", "--backend", "torch", "train.stepz=1"]) == 2
    assert "unknown key 'train.stepz'" in capsys.readouterr().err


def test_core_imports_no_framework():
    code = (
        "import sys, hstu, hstu.batch, hstu.workload, hstu.partition, hstu.shuffle_plan, "
        "hstu.pipeline, hstu.config, hstu.data, hstu.params, hstu.metrics, hstu.backends, "
        "hstu.cli; bad = [m for m in ('torch', 'jax', 'flax') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
