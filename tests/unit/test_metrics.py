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
    # step 0 compiles (warm-up); steps 3 and 6 meet new shape buckets and compile again
    times = [9000.0, 10.0, 12.0, 1300.0, 11.0, 13.0, 1250.0, 9.0]
    rows = _rows(times, compiles=[1, 1, 1, 2, 2, 2, 3, 3])
    s = summarize(rows)
    assert s["steps"] == 8 and s["steps_timed"] == 5
    assert s["step_time_s"] == pytest.approx(11.0 / 1e3)  # median of 10, 12, 11, 13, 9
    assert s["first_loss"] == 2.0 and s["last_loss"] == pytest.approx(1.3)
    assert "steps timed (no compile)" in format_summary(s)


def test_rows_without_a_compile_count_skip_only_the_warm_up():
    s = summarize(_rows([500.0, 30.0, 20.0, 40.0]))
    assert s["steps_timed"] == 3 and s["step_time_s"] == pytest.approx(0.030)
    # fewer steps than the warm-up: nothing is left out rather than nothing reported
    one = summarize(_rows([500.0]))
    assert one["steps_timed"] == 1 and one["step_time_s"] == pytest.approx(0.5)
    assert summarize([]) == {}
