"""`hstu bench tables`: the runs it plans, what a table costs per device, and one CPU run of
both backends at W=2 with sharded and replicated tables."""

from __future__ import annotations

import json

import pytest

from hstu import backends
from hstu.bench.tables import plan_runs, table_gib_per_device
from hstu.cli import main


def test_runs_alternate_backends_and_rows_then_the_replicated_run():
    assert plan_runs(["torch", "jax"], [10, 20], "row_wise", 5) == [
        ("torch", "row_wise", 10),
        ("torch", "row_wise", 20),
        ("jax", "row_wise", 10),
        ("jax", "row_wise", 20),
        ("torch", "none", 5),
        ("jax", "none", 5),
    ]
    assert plan_runs(["jax"], [10], "table_wise", 0) == [("jax", "table_wise", 10)]


def test_table_bytes_per_device_follow_the_sharding():
    rows, dim = 200_000_000, 128  # the table: 102 GB, 51 GB per device at W=2
    assert table_gib_per_device(rows, dim, "none", 2) * 2**30 == rows * dim * 4
    assert table_gib_per_device(rows, dim, "row_wise", 2) * 2**30 == rows * dim * 2
    # uneven rows: the largest shard
    assert table_gib_per_device(5, 1, "row_wise", 2) * 2**30 == 3 * 4
    assert table_gib_per_device(5, 1, "table_wise", 2) * 2**30 == 5 * 4


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--rows", "10,x"], "--rows takes integers"),
        (["--rows", "0"], "must be positive"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--sharding", "none"], "names a sharded layout"),
        (["--backends", "torch,tf"], "unknown backend(s) ['tf']"),
        (["model.num_layers=oops"], "num_layers"),
    ],
)
def test_bad_arguments_fail_before_any_run(argv, match, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "tables", "--config", "demo", "--out", str(out), *argv]) == 2
    assert match in capsys.readouterr().err
    assert not out.exists()  # nothing ran


@pytest.mark.slow
@pytest.mark.multirank
def test_tables_bench_on_cpu_both_backends(tmp_path, capsys):
    for name in ("torch", "jax"):
        ok, why = backends.available(name)
        if not ok:
            pytest.skip(why)
    argv = [
        *("bench", "tables", "--config", "demo", "--rows", "3000,9000", "--replicated", "3000"),
        *("--steps", "4", "--out", str(tmp_path), "dist.world_size=2", "model.num_layers=1"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "tables.json").read_text())
    assert report["world_size"] == 2 and report["repeats"] == 1
    got = {(r["backend"], r["sharding"], r["rows"]): r for r in report["runs"]}
    assert sorted(got) == sorted(plan_runs(["torch", "jax"], [3000, 9000], "row_wise", 3000))
    for (b, s, n), r in got.items():
        assert r["step_ms"] > 0 and r["step_ms_runs"] == [pytest.approx(r["step_ms"])]
        assert r["max_memory_gib"] is None  # no device memory on a CPU
        assert r["table_gib_per_device"] == table_gib_per_device(n, 64, s, 2)
        if s == "row_wise":
            base = got[(b, s, 3000)]["step_ms"]
            assert r["vs_smallest"] == pytest.approx(r["step_ms"] / base)
        else:
            assert "vs_smallest" not in r
        assert (tmp_path / f"{b}-{s}-{n}" / "run0" / "metrics.jsonl").is_file()
    assert "[6/6] jax 3,000 rows none" in printed
