"""Run summaries: medians after warm-up, with steps that compiled a new program left out."""

import pytest

from hstu.metrics import format_summary, summarize


def _rows(times_ms, compiles=None):
    rows = []
    for i, t in enumerate(times_ms):
        row = {"step": i, "loss": 2.0 - 0.1 * i, "step_time_s": t / 1e3, "tokens_per_s": 1e6 / t}
        if compiles is not None:
            row["num_compiles"] = compiles[i]
        rows.append(row)
    return rows


def test_steps_that_compile_are_left_out_of_the_medians():
    # step 0 compiles (warm-up); steps 3 and 6 meet new shape buckets and compile again. A
    # row's time is the iteration in which its metrics arrive, which dispatches the next
    # step: the compile of step 3 shows in row 2's time, its count in row 3's.
    times = [9000.0, 10.0, 1300.0, 12.0, 11.0, 1250.0, 13.0, 9.0]
    rows = _rows(times, compiles=[1, 1, 1, 2, 2, 2, 3, 3])
    s = summarize(rows)
    assert s["steps"] == 8 and s["steps_timed"] == 3
    assert s["step_time_s"] == pytest.approx(10.0 / 1e3)  # median of 10, 11, 9
    assert s["first_loss"] == 2.0 and s["last_loss"] == pytest.approx(1.3)
    assert "steps timed (no compile)" in format_summary(s)


def test_rows_without_a_compile_count_skip_only_the_warm_up():
    s = summarize(_rows([500.0, 30.0, 20.0, 40.0]))
    assert s["steps_timed"] == 3 and s["step_time_s"] == pytest.approx(0.030)
    # fewer steps than the warm-up: nothing is left out rather than nothing reported
    one = summarize(_rows([500.0]))
    assert one["steps_timed"] == 1 and one["step_time_s"] == pytest.approx(0.5)
    assert summarize([]) == {}


def _row(step, loss=1.0):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 0.5,
        "global_tokens": 100,
        "imbalance_before": 1.3,
        "imbalance_after": 1.0,
        "rank_workloads_before": [3.0, 1.0],
        "rank_workloads_after": [2.0, 2.0],
        "step_time_s": 0.01,
        "tokens_per_s": 1e4,
        "tflops_per_device": 1.0,
        "num_compiles": 1 + step // 2,
    }


def test_tensorboard_scalars_are_written_without_a_framework(tmp_path):
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hstu.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 3, progress=False)
    for s in range(3):
        logger.log(s, _row(s, loss=2.0 - s))
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [2.0, 1.0, 0.0]
    assert [e.step for e in acc.Scalars("grad_norm")] == [0, 1, 2]
    # and none of it needs a framework: the same writer with torch and jax blocked
    code = (
        "from hstu.testing import block_backends; block_backends(); "
        "from hstu.metrics import TensorBoardWriter; "
        f"w = TensorBoardWriter({str(tmp_path / 'tb2')!r}); w.scalars(0, {{'loss': 1.0}}); "
        "w.close()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert list((tmp_path / "tb2").glob("events.out.tfevents.*"))


def test_progress_bar_keeps_the_log_lines(tmp_path):
    import io

    from hstu.metrics import MetricsLogger

    out = io.StringIO()
    logger = MetricsLogger(tmp_path, 4, log_every=2, progress=True, stream=out)
    for s in range(4):
        logger.log(s, _row(s))
    logger.print("checkpoint: saved somewhere")
    logger.close()
    lines = out.getvalue().splitlines()
    assert [ln.split("|")[0].strip() for ln in lines[:2]] == ["step    0", "step    2"]
    assert lines[2] == "checkpoint: saved somewhere"


def test_a_resumed_run_rewrites_the_lines_it_trains_again(tmp_path):
    from hstu.metrics import MetricsLogger, read_rows

    logger = MetricsLogger(tmp_path, 5, progress=False, tensorboard=False)
    for s in range(5):
        logger.log(s, _row(s))
    logger.close()
    resumed = MetricsLogger(tmp_path, 6, start_step=3, progress=False, tensorboard=False)
    for s in range(3, 6):
        resumed.log(s, _row(s, loss=9.0))
    resumed.close()
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["loss"] for r in rows] == [1.0, 1.0, 1.0, 9.0, 9.0, 9.0]


def test_plot_writes_the_pngs_of_a_run(tmp_path, capsys):
    from hstu.cli import main
    from hstu.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 6, progress=False, tensorboard=False)
    for s in range(6):
        logger.log(s, _row(s, loss=2.0 / (s + 1)))
    logger.close()
    assert main(["plot", str(tmp_path)]) == 0
    for name in ("loss.png", "throughput.png", "balance.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl is missing" in capsys.readouterr().err
