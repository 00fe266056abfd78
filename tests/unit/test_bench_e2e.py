"""`hstu bench e2e` on CPU, both backends: every field written, the breakdown adds up, the
simulation runs and agrees with what the runs measured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hstu import backends
from hstu.cli import main
from hstu.pipeline import HOST_PHASES
from hstu.testing import load_script

for _name in ("torch", "jax"):
    _ok, _why = backends.available(_name)
    if not _ok:
        pytest.skip(_why, allow_module_level=True)

RUN_FIELDS = {
    "steps",
    "compile_s",
    "steps_timed",
    "step_ms",
    "step_p90_ms",
    "step_mean_ms",
    "tokens_per_s",
    "tflops_per_device",
    "tflops_overall",
    "mfu",
    "max_memory_gib",
    "imbalance_flops_before",
    "imbalance_flops_after",
    "imbalance_time_before",
    "imbalance_time_after",
    "rank_compute_ms_before",
    "rank_compute_ms_after",
    "balancer_ms",
    "exposed_balancer_ms",
    "exposed_balancer_share",
    "padding_waste",
    "num_compiles",
    "loss_last",
    "host_ms",
    "host_sum_ms",
    "device_ms",
    "speedup",
    "step_ms_runs",
    "speedup_runs",
    "step_s_runs",
    "speedup_paired",
    "steps_paired",
}


@pytest.mark.multirank
@pytest.mark.slow
def test_e2e_bench_on_the_demo_recipe(tmp_path, capsys):
    argv = [
        *("bench", "e2e", "--config", "demo", "--exchanges", "allgather"),
        *("--steps", "9", "--probe-every", "3", "--breakdown", "--simulate-ranks", "2"),
        *("--out", str(tmp_path)),
        *("dist.world_size=2", "model.num_layers=1", "data.batch_size=6", "data.max_history=32"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["world_size"] == 2
    assert sorted(report["runs"]) == [
        "jax/balanced/allgather",
        "jax/identity/-",
        "torch/balanced/allgather",
        "torch/identity/-",
    ]
    for key, r in report["runs"].items():
        assert set(r) == RUN_FIELDS, (key, set(r) ^ RUN_FIELDS)
        assert r["step_ms_runs"] == [pytest.approx(r["step_ms"])]  # one run: its own median
        assert r["speedup_runs"] == [pytest.approx(r["speedup"])]
        assert r["mfu"] is None and r["max_memory_gib"] is None  # no peak, no device memory
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["steps_timed"] >= 3
        if key.startswith("jax/"):  # every new shape bucket compiles (seconds on a CPU)
            assert r["num_compiles"] >= 1 and r["compile_s"] > 1e-3 * r["step_ms"]
        # the host phases are the step as the host sees it: they account for it exactly
        assert set(r["host_ms"]) == set(HOST_PHASES)
        assert r["host_sum_ms"] == pytest.approx(r["step_mean_ms"], rel=1e-6)
        # probes measured every rank, before and after the shuffle
        assert len(r["rank_compute_ms_before"]) == len(r["rank_compute_ms_after"]) == 2
        assert all(t > 0 for t in r["rank_compute_ms_after"])
        assert r["imbalance_time_before"] >= 1.0 and r["imbalance_time_after"] >= 1.0
        if "/balanced/" in key:
            assert r["imbalance_flops_after"] < r["imbalance_flops_before"]
            assert r["balancer_ms"] > 0
    for key in ("jax/identity/-", "jax/balanced/allgather"):
        dev = report["runs"][key]["device_ms"]
        assert all(np.isfinite(dev[p]) and dev[p] >= 0 for p in dev), dev
    for b in ("torch", "jax"):
        sim = report["simulation"][b]
        assert sim["world"] == 2
        assert sim["balanced"]["imbalance_flops"] < sim["identity"]["imbalance_flops"]
        assert sim["identity"]["projected_step_s"] > 0 and sim["projected_speedup"] > 0
        # what the real W=2 run adds: its gradient reduction, and the balancer's exposed time
        real = report["runs"][f"{b}/balanced/allgather"]
        assert sim["exchange_s"] == pytest.approx(real["exposed_balancer_ms"] / 1e3)
        # the real speedup set against the projection with what the real run adds
        assert sim["real_speedup"] == pytest.approx(real["speedup"])
        ident, bal = sim["identity"]["projected_step_s"], sim["balanced"]["projected_step_s"]
        assert sim["projected_speedup_with_run"] == pytest.approx(
            (ident + sim["extra_s"]) / (bal + sim["extra_s"] + sim["exchange_s"])
        )
        share = sim["share_of_projected_gain"]
        assert share is None or share == pytest.approx(
            (real["speedup"] - 1) / (sim["projected_speedup_with_run"] - 1)
        )
        # over the same batches: the simulation's batches are the run's steps 1..8
        assert sim["batches"] == list(range(1, 9))
        paired = sim["paired"]
        assert 3 <= paired["steps"] <= 7 and paired["real"] > 0 and paired["projected"] > 0
    assert "projected balanced speedup at W=2" in printed
    assert "balanced speedup, medians: real" in printed
    assert "balanced speedup, total time over the same" in printed
    assert "breakdown torch/balanced/allgather" in printed
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"


def test_simulation_pads_each_split_as_its_own_run():
    """The simulated ranks pad to the capacities a W-rank run of that split fits, not to the
    capacities of the configured (here 1-rank) run."""
    from hstu.bench.simulate import run_policy
    from hstu.capacity import for_source
    from hstu.config import load_config
    from hstu.data import source_from_config

    data = ["data.batch_size=16", "data.max_history=1000"]
    cfg = load_config("demo", [*data, "dist.world_size=1"])
    source = source_from_config(cfg)
    got = {s: run_policy(cfg, 4, s, source) for s in ("identity", "balanced")}
    for s, policy in got.items():
        run = load_config("demo", [*data, "dist.world_size=4", f"balance.shuffler={s}"])
        assert policy == for_source(run, source)
    # balancing evens the ranks: the largest rank, hence every capacity, is smaller
    assert got["balanced"].capacities[-2] < got["identity"].capacities[-2]
    assert got["identity"] != for_source(cfg, source)
    assert cfg.dist.world_size == 1  # the caller's config is left alone


def _sharded_sim_setup():
    from hstu.config import load_config
    from hstu.data import DataLoader, source_from_config
    from hstu.embedding_opt import touched_rows

    cfg = load_config(
        "demo",
        [
            *("model.num_layers=1", "data.batch_size=6", "data.max_history=32"),
            *("model.num_items=501", "model.num_contextual_ids=41", "dist.device=cpu"),
            *("embedding.sharding=data_parallel", "embedding.optimizer=adam"),
            "embedding.weight_decay=0.5",  # zero gradients: the decay moves each updated row
        ],
    )
    batches = next(DataLoader(source_from_config(cfg), cfg.data.batch_size, 2, range(2)))
    return cfg, batches, touched_rows(batches)


def _moved(before, after) -> np.ndarray:
    return np.flatnonzero(np.any(np.asarray(before) != np.asarray(after), axis=1))


@pytest.mark.slow  # ~13 s for both: `make test-slow`
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_simulation_with_sharded_tables_times_rows_and_updates_the_touched_ones(backend):
    """`--simulate-ranks` with sharded tables: each rank timed from its looked-up rows, and
    the update moves the rows one global batch touches, no other."""
    cfg, batches, touched = _sharded_sim_setup()
    assert touched["item"].size < cfg.model.num_items  # some rows untouched
    if backend == "torch":
        from hstu.torch_backend.timing import LocalTimer

        timer = LocalTimer(cfg, device="cpu", repeats=1)
        assert all(t > 0 for t in timer.time_ranks(batches))
        before = {n: t.detach().clone().numpy() for n, t in timer.tables.items()}
        assert timer.time_optimizer(batches) > 0
        after = {n: t.detach().numpy() for n, t in timer.tables.items()}
    else:
        import jax

        from hstu.jax_backend.timing import LocalTimer

        timer = LocalTimer(cfg, repeats=1)
        assert all(t > 0 for t in timer.time_ranks(batches))
        assert timer.time_optimizer(batches) > 0
        update, routes, g_rows = timer.update_program(batches)
        st = timer.state
        before = {n: np.asarray(w) for n, w in st.tables["weights"].items()}
        copy = jax.tree.map(jax.numpy.copy, (st.params, st.opt_state, st.tables))
        (_, _, tables), _ = update(copy, routes, g_rows)
        after = {n: np.asarray(w)[: before[n].shape[0]] for n, w in tables["weights"].items()}
    for name, rows in touched.items():
        np.testing.assert_array_equal(_moved(before[name], after[name]), rows, err_msg=name)


def test_jax_median_time_is_per_call_with_calls_back_to_back():
    """Each sample dispatches several calls before one wait and reports the time per call."""
    import time

    import jax.numpy as jnp

    from hstu.jax_backend.timing import median_time

    calls = []

    def run():
        calls.append(1)
        time.sleep(0.01)
        return jnp.zeros(())

    sec = median_time(run, repeats=3, warmup=1, back_to_back=4)
    assert len(calls) == 1 + 3 * 4
    assert 0.01 <= sec < 0.02  # one call's time, not four


def test_jax_chained_timing_donates_a_copy_and_leaves_the_state():
    """The update is timed in place (inputs donated, each call fed the last one's output) on a
    copy: the caller's params and optimizer state stay alive and unchanged."""
    import jax
    import jax.numpy as jnp
    import optax

    from hstu.jax_backend.timing import donated_update, time_chained

    opt = optax.adamw(0.1, weight_decay=0.5)
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    state = (params, opt.init(params))
    update = donated_update(opt)
    calls = []

    def counted(s):
        calls.append(1)
        return update(s)

    sec = time_chained(counted, state, repeats=2)
    assert sec > 0 and len(calls) == 1 + 2 * 4  # warm-up, then 2 samples of 4 chained calls
    np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(6.0).reshape(2, 3))
    (new, _), _ = update(jax.tree.map(jnp.copy, state))  # AdamW decays weights on zero grads
    assert not np.allclose(np.asarray(new["w"]), np.asarray(params["w"]))


@pytest.mark.slow
def test_e2e_bench_repeats_alternate_and_pool(tmp_path, capsys):
    """`--repeats 2`: rounds of identity then balanced, each run in its own folder; a row pools
    its runs' steps and keeps each run's median and its speedup over the same round's identity."""
    argv = [
        *("bench", "e2e", "--config", "demo", "--backends", "torch", "--exchanges", "allgather"),
        *("--steps", "6", "--probe-every", "0", "--repeats", "2", "--out", str(tmp_path)),
        *("dist.world_size=1", "model.num_layers=1", "data.batch_size=4", "data.max_history=32"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["repeats"] == 2
    ident, bal = report["runs"]["torch/identity/-"], report["runs"]["torch/balanced/allgather"]
    for r in (ident, bal):
        assert len(r["step_ms_runs"]) == 2 and r["steps"] == 12  # both runs' rows
        assert min(r["step_ms_runs"]) <= r["step_ms"] <= max(r["step_ms_runs"])
    assert ident["speedup_runs"] == [1.0, 1.0]
    for a, b, sp in zip(ident["step_ms_runs"], bal["step_ms_runs"], bal["speedup_runs"]):
        assert sp == pytest.approx(a / b)
    for name in ("torch-identity--", "torch-balanced-allgather"):
        for rnd in (0, 1):
            assert (tmp_path / name / f"run{rnd}" / "metrics.jsonl").is_file()
    assert "[4/4] torch/balanced/allgather" in printed and "per run (rounds" in printed


def test_paired_speedup_counts_the_same_batches_round_by_round():
    """A speedup over the same global batches: the steps both runs of a round timed (a step
    one run left out, e.g. for a graph capture, is left out of both), totals, not medians."""
    from hstu.bench.e2e import paired_projection, paired_totals

    ident = [[[2, 0.020], [3, 0.010], [4, 0.030], [5, 0.012]], [[2, 0.022], [4, 0.028]]]
    bal = [[[2, 0.016], [4, 0.020], [5, 0.010], [6, 0.5]], [[2, 0.018], [3, 0.01], [4, 0.024]]]
    t_ident, t_bal, steps = paired_totals(ident, bal)
    assert steps == [2, 4, 5, 2, 4]  # round 0: 3 and 6 timed by one run only; round 1: 3
    assert t_ident == pytest.approx(0.020 + 0.030 + 0.012 + 0.022 + 0.028)
    assert t_bal == pytest.approx(0.016 + 0.020 + 0.010 + 0.018 + 0.024)
    assert paired_totals(ident, bal, only={4})[2] == [4, 4]
    # the medians' ratio reads a different thing: identity 0.021 vs balanced 0.018 medians
    sim = {
        "batches": [1, 2, 3, 4],  # the simulation timed steps 1..4: step 5 is left out
        "identity": {"per_batch_step_s": [9.0, 0.020, 0.011, 0.026]},
        "balanced": {"per_batch_step_s": [9.0, 0.015, 0.010, 0.020]},
    }
    got = paired_projection(sim, {"step_s_runs": ident}, {"step_s_runs": bal}, 0.001, 0.0005)
    assert got["steps"] == 4  # steps 2 and 4 of both rounds
    assert got["real"] == pytest.approx(
        (0.020 + 0.030 + 0.022 + 0.028) / (0.016 + 0.020 + 0.018 + 0.024)
    )
    proj = (2 * 0.021 + 2 * 0.027) / (2 * 0.0165 + 2 * 0.0215)
    assert got["projected"] == pytest.approx(proj)
    assert got["share"] == pytest.approx((got["real"] - 1) / (proj - 1))
    none = paired_projection({**sim, "batches": [7]}, {"step_s_runs": ident}, {"step_s_runs": bal})
    assert none == {"steps": 0, "real": None, "projected": None, "share": None}


def test_padding_is_the_mean_over_every_step():
    """Issue 13 bounds the padding "on average": a run whose steps mostly fit their capacity
    exactly but pad a few heavily reports the mean (warm-up included), not the median (0)."""
    from hstu.bench.e2e import summarize_run

    def row(step, waste):
        return {
            "step": step,
            "step_time_s": 0.01,
            "tokens_per_s": 1e5,
            "tflops_per_device": 1.0,
            "imbalance_before": 1.0,
            "imbalance_after": 1.0,
            "balancer_s": 0.0,
            "exposed_balancer_s": 0.0,
            "padding_waste": waste,
            "num_compiles": 1,
            "loss": 1.0,
            "host_s": dict.fromkeys(HOST_PHASES, 0.01 / len(HOST_PHASES)),
        }

    wastes = [0.5, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.2]
    out = summarize_run([[row(i, w) for i, w in enumerate(wastes)]], world=1)
    assert out["padding_waste"] == pytest.approx(0.1)
    assert out["num_compiles"] == 1 and out["steps"] == 10


def test_build_time_is_what_the_building_steps_take_above_the_median():
    """`compile_s`: the first step and each step whose program count rises (or whose next
    row's does: its loop iteration dispatched the next step) count their time above the
    median of the timed steps; a slow step that built nothing does not count."""
    from hstu.metrics import build_seconds

    times = [3.0, 0.1, 0.1, 2.1, 0.1, 0.1, 0.6, 0.1, 0.1, 0.1]
    counts = [1, 1, 1, 1, 2, 2, 2, 2, 2, 2]  # row 4's count rises: rows 3 and 4 built
    rows = [
        {"step": i, "step_time_s": t, "num_compiles": c}
        for i, (t, c) in enumerate(zip(times, counts, strict=True))
    ]
    # timed: rows 2, 5..9 (row 6's 0.6 s among them): median 0.1
    assert build_seconds(rows, skip_warmup=2) == pytest.approx((3.0 - 0.1) + (2.1 - 0.1))
    assert build_seconds([], skip_warmup=2) == 0.0


def test_with_a_fetch_lag_the_build_lands_that_many_rows_before_the_count_rises():
    """Rows fetched 2 steps late (`train.metrics_lag=2`): the iteration that built step 5's
    program is row 3's time, and row 5's count is the first to rise, so rows 3..5 are left out
    of the median and row 3's excess is the build."""
    from hstu.metrics import build_seconds, timed_rows

    times = [3.0, 0.1, 0.1, 2.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    counts = [1, 1, 1, 1, 1, 2, 2, 2, 2, 2]
    rows = [
        {"step": i, "step_time_s": t, "num_compiles": c, "fetch_lag": 2}
        for i, (t, c) in enumerate(zip(times, counts, strict=True))
    ]
    assert [r["step"] for r in timed_rows(rows, skip_warmup=1)] == [1, 2, 6, 7, 8, 9]
    assert build_seconds(rows, skip_warmup=1) == pytest.approx((3.0 - 0.1) + (2.1 - 0.1))
    # the same rows read with the default lag of 1 would time row 3's build
    lag1 = [{k: v for k, v in r.items() if k != "fetch_lag"} for r in rows]
    assert 3 in [r["step"] for r in timed_rows(lag1, skip_warmup=1)]


def test_breakdown_of_a_step_graph_reports_its_one_device_phase():
    """A torch step replayed from one graph has no phases inside: the breakdown gives the
    step's device time instead of calling it unmeasured."""
    from hstu.bench.e2e import DEVICE_PHASES, format_breakdown

    r = {
        "host_ms": {"dispatch": 1.0, "fetch_wait": 9.0},
        "host_sum_ms": 10.0,
        "step_mean_ms": 10.0,
        "step_ms": 10.0,
        "device_ms": {**dict.fromkeys(DEVICE_PHASES, float("nan")), "step": 8.0},
    }
    text = format_breakdown("torch identity -", r)
    assert "rank 0's step span 8.00 ms, 80% of the median step 10.00" in text
    r["device_ms"]["step"] = float("nan")
    assert "device phases: not measured" in format_breakdown("torch identity -", r)


def test_overall_rate_is_the_timed_steps_flops_over_their_time():
    """`tflops_overall`: the timed steps' FLOPs over their summed time, where
    `tflops_per_device` is the median step's rate (which step sits in the middle decides it)."""
    from hstu.bench.e2e import summarize_run

    def row(step, t, tf):
        return {
            "step": step,
            "step_time_s": t,
            "tokens_per_s": 1e5,
            "tflops_per_device": tf,
            "imbalance_before": 1.0,
            "imbalance_after": 1.0,
            "balancer_s": 0.0,
            "exposed_balancer_s": 0.0,
            "padding_waste": 0.0,
            "num_compiles": 1,
            "loss": 1.0,
            "host_s": dict.fromkeys(HOST_PHASES, t / len(HOST_PHASES)),
        }

    # two warm-up steps (left out), then short slow steps and long fast ones
    times = [1.0, 1.0, 0.004, 0.004, 0.004, 0.030, 0.030]
    rates = [1.0, 1.0, 100.0, 100.0, 100.0, 300.0, 300.0]
    out = summarize_run(
        [[row(i, t, f) for i, (t, f) in enumerate(zip(times, rates, strict=True))]], 1
    )
    assert out["steps_timed"] == 5
    assert out["tflops_per_device"] == pytest.approx(100.0)
    want = (3 * 0.004 * 100 + 2 * 0.030 * 300) / (3 * 0.004 + 2 * 0.030)
    assert out["tflops_overall"] == pytest.approx(want)


# ------------------------------------------------------------------ scripts/ab_paired.py
def _ab_paired():
    return load_script("ab_paired")


def _e2e_json(out: Path, steps: dict[int, float], key: str = "jax/identity/-") -> str:
    out.mkdir(parents=True)
    runs = {key: {"step_s_runs": [[[k, v] for k, v in steps.items()]]}}
    (out / "e2e.json").write_text(json.dumps({"runs": runs}))
    return str(out)


def test_ab_paired_compares_the_same_steps_round_by_round(tmp_path, capsys):
    """Two trees' runs over the same batches: totals over the steps both timed in a round (a
    step one side left out, e.g. a capture, counts on neither), their ratio per round and
    over all, and the per-step ratios' median, which one slow step does not move."""
    ab = _ab_paired()
    before = [
        _e2e_json(tmp_path / "b1", {2: 0.010, 3: 0.020, 4: 0.030, 5: 0.040}),
        _e2e_json(tmp_path / "b2", {2: 0.010, 3: 0.020, 4: 0.030, 5: 0.040}),
    ]
    after = [  # 2 % faster on every step; round 1 did not time step 5, round 2 had one stall
        _e2e_json(tmp_path / "a1", {2: 0.0098, 3: 0.0196, 4: 0.0294}),
        _e2e_json(tmp_path / "a2", {2: 0.0098, 3: 0.0196, 4: 0.0294, 5: 0.4}),
    ]
    result = ab.compare(ab._runs(before), ab._runs(after))
    r = result["jax/identity/-"]
    assert [n for n, _, _ in r["rounds"]] == [3, 4]
    n, tb, ta = r["rounds"][0]
    assert tb == pytest.approx(0.060) and ta == pytest.approx(0.0588)
    assert r["before_s"] == pytest.approx(0.160) and r["after_s"] == pytest.approx(0.5176)
    assert r["step_ratio_q"][1] == pytest.approx(1 / 0.98)
    assert ab.main(["--before", *before, "--after", *after]) == 0
    table = capsys.readouterr().out
    assert "1.0204" in table and "per step: median 1.0204" in table
    with pytest.raises(ValueError, match="2 before runs against 1 after"):
        ab.compare(ab._runs(before), ab._runs(after[:1]))
    with pytest.raises(SystemExit, match="e2e.json not found"):
        ab.main(["--before", str(tmp_path), "--after", str(tmp_path)])
