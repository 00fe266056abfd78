"""JAX sharded embedding tables (`embedding.sharding` != none) on 2 and 4 host devices.

Against the dense (replicated) model and `hstu.embedding_opt` (the numpy reference of
docs/MODEL.md), with tables whose rows do not divide by the world size:

* the lookup (ids to owners, rows back by all_to_all) returns exactly the dense gather;
* one step (two for adam's bias correction) updates the tables as the reference does from the
  dense model's gradient, at the touched rows only (every other row and its state
  bit-identical), the loss equal to the dense model's, the dense params as dense AdamW's;
* identity and balanced shuffling give the same loss and the same tables;
* a compiled step's temporaries do not grow with the table (1M vs 100M rows);
* an Orbax checkpoint resumes bit-exactly, and `hstu convert`'s portable state round-trips.

Each worker runs in a fresh interpreter (the host device count is fixed at JAX start):
`python tests/multirank/test_sharded_jax.py <worker> <json kwargs>` prints `RESULT <json>`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# rows not divisible by 2 or 4; 1 layer keeps compiles short
SMALL = ["model.num_layers=1", "model.num_items=1001", "model.num_actions=7"]
SMALL += ["model.num_contextual_ids=99", "data.max_history=24", "embedding.lr=0.05"]


def run(worker: str, devices: int, timeout: float = 300, **kwargs) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HSTU_TEST_DEVICES=str(devices))
    # runs in a worker compile the same programs again (train, resume): JAX's persistent cache,
    # shared with tests/multirank/jax_workers.py
    cache = Path(tempfile.gettempdir()) / f"hstu-jax-test-cache-{os.getuid()}"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    proc = subprocess.run(
        [sys.executable, __file__, worker, json.dumps(kwargs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{worker} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


# ------------------------------------------------------------------------------ tests
pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # ~25 s: `make test-slow`
STEP_CASES = [  # world size, task, optimizer, sharding
    (4, "ranking", "row_wise_adagrad", "row_wise"),
    (4, "retrieval", "adam", "table_wise"),
    (2, "retrieval", "row_wise_adagrad", "data_parallel"),
    (2, "ranking", "adam", "data_parallel"),
    (1, "ranking", "adam", "data_parallel"),  # one rank: its distinct ids, no re-sort
]


@pytest.fixture(scope="module")
def steps():
    pytest.importorskip("jax")
    return run("steps_worker", devices=4, cases=STEP_CASES)


def test_lookup_equals_dense_gather(steps):
    for case in steps["lookup"]:
        assert case["exact"] and case["unique_ok"], case


@pytest.mark.parametrize("case", range(len(STEP_CASES)), ids=[str(c) for c in STEP_CASES])
def test_step_matches_reference_and_touches_rows_only(steps, case):
    r = steps["steps"][case]
    assert r["loss_rel"] < 1e-6, r  # step 0: the dense model's loss
    assert r["grad_norm_rel"] < 1e-4, r
    assert r["touched"] > 0 and r["untouched"] > 0, r
    assert r["untouched_identical"], r  # rows, padding rows and their state: bit-identical
    assert r["table_err"] < 1e-5 and r["state_err"] < 1e-5, r  # vs hstu.embedding_opt
    assert r["dense_err"] < 1e-5, r  # the dense params: AdamW as with dense tables
    assert r["count"] == r["steps"], r


def test_identity_and_balanced_agree(steps):
    for r in steps["invariance"]:
        assert r["moved"] > 0 and r["loss_rel"] < 1e-6 and r["table_err"] < 1e-6, r


def test_step_memory_does_not_grow_with_the_table(steps):
    small, large = steps["memory"]["temp_bytes"]
    # the 100M-row table is 25.6 GB: a dense [rows, D] temporary would show at once
    assert abs(large - small) <= 0.01 * max(small, 1 << 20), steps["memory"]
    small, large = steps["memory"]["fresh_output_bytes"]  # the tables are updated in place
    assert abs(large - small) <= 0.01 * max(small, 1 << 20), steps["memory"]


def test_checkpoint_resume_and_convert(tmp_path):
    pytest.importorskip("jax")
    r = run("resume_worker", devices=4, out=str(tmp_path))
    assert r["full_steps"] == [0, 1, 2, 3] and r["resumed_steps"] == [2, 3]
    assert r["resumed_losses"] == r["full_losses"][2:]  # bit-exact
    assert r["state_identical"], r["state_diff"]
    assert r["step0_equals_dense"], r
    assert r["portable"]["optimizer"] == "adam" and r["portable"]["count"] == 4
    assert r["portable"]["m_item_shape"] == [1001, 64]
    assert r["portable"]["dense_only_adam"]
    assert r["roundtrip_identical"] and r["regrid_identical"], r
    assert r["on_four_steps"] == [2, 3]  # resumed at another world size: the same curve
    assert r["on_four_losses"] == pytest.approx(r["full_losses"][2:], rel=1e-5)


def test_probes_time_sharded_tables_and_leave_training_alone(tmp_path):
    """`bench.probe_every` with sharded tables: every rank's forward + backward from its
    looked-up rows and the step's phases are timed, and a run probed every step trains
    exactly as one never probed (the probes' programs work on copies)."""
    pytest.importorskip("jax")
    r = run("probe_worker", devices=2, out=str(tmp_path))
    for sharding, (probed, plain) in r.items():
        assert [x["loss"] for x in probed] == [x["loss"] for x in plain], sharding  # bit-exact
        for row in probed[1:]:  # step 0 compiles: probed from step 1
            assert len(row["compute_s_before"]) == len(row["compute_s_after"]) == 2
            assert all(t > 0 for t in row["compute_s_before"] + row["compute_s_after"]), row
            dev = row["device_s"]
            assert set(dev) == {"forward", "backward", "grad_reduce", "optimizer", "step"}
            assert dev["step"] > 0 and dev["optimizer"] > 0 and dev["forward"] > 0, (sharding, dev)


# ------------------------------------------------------------------------------ workers
def _cfg(*overrides: str):
    from hstu.config import load_config
    from hstu.testing import DEMO_CONFIG

    return load_config(DEMO_CONFIG, [*SMALL, *overrides])


def _touched(host, keys):
    import numpy as np

    vals = [np.asarray(b.values[k]) for b in host for k in keys if k in b.values]
    return np.unique(np.concatenate(vals)) if vals else np.zeros((0,), np.int64)


def _lookup_cases(mesh_of) -> list:
    """Random ids (repeats, capacity padding) on every rank: cached rows == table[ids]."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hstu.jax_backend import embedding as emb
    from hstu.jax_backend.collectives import DATA_AXIS, shard_map

    out = []
    for w, rows in ((2, 11), (4, 13), (4, 3)):
        mesh = mesh_of(w)
        lay = emb.TableLayout("item", rows, 5, w, False)
        rng = np.random.default_rng(rows)
        table = rng.normal(size=(rows, 5)).astype(np.float32)
        ids = rng.integers(0, rows, size=(w, 9)).astype(np.int32)
        real = rng.random((w, 9)) < 0.7

        def body(shard, ids, real, lay=lay, rows=rows):
            uniq = emb.unique_ids(ids[0], real[0], lay)
            route = emb.plan_route(uniq, lay, DATA_AXIS)
            cache = emb.gather_rows(shard, route, lay, DATA_AXIS)
            looked = emb.cached_lookup(uniq, cache, ids[0], rows)
            return uniq[None], looked[None]

        f = shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS))
        shard = jax.device_put(emb.pad_rows(table, lay), NamedSharding(mesh, P(DATA_AXIS)))
        uniq, looked = jax.jit(f)(shard, jnp.asarray(ids), jnp.asarray(real))
        uniq, looked = np.asarray(uniq), np.asarray(looked)
        exact = all(np.array_equal(looked[r][real[r]], table[ids[r][real[r]]]) for r in range(w))
        unique_ok = all(
            np.array_equal(uniq[r][uniq[r] < lay.sentinel], np.unique(ids[r][real[r]]))
            for r in range(w)
        )
        out.append({"world": w, "rows": rows, "exact": bool(exact), "unique_ok": bool(unique_ok)})
    return out


def _rel(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))


def _step_case(mesh, task, optimizer, sharding) -> dict:
    """Two sharded steps on one batch against the dense model's gradient + embedding_opt."""
    import jax
    import numpy as np
    import optax

    from hstu import embedding_opt
    from hstu.jax_backend import embedding as emb
    from hstu.jax_backend.model import build_model, flax_to_params, params_to_flax
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.state import dense_params, init_sharded_state
    from hstu.jax_backend.train_step import (
        full_params,
        make_loss_fn,
        make_optimizer,
        make_sharded_train_step,
    )
    from hstu.params import init_params
    from hstu.pipeline import STAT_LOSS_TOKENS, sample_stats
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    w = mesh.size
    cfg = _cfg(
        f"model.task={task}",
        f"embedding.optimizer={optimizer}",
        f"embedding.sharding={sharding}",
        f"embedding.weight_decay={0.01 if optimizer == 'adam' else 0.0}",
    )
    params = init_params(cfg.model, 0)
    optimizer_d = make_optimizer(cfg.train)
    setup = emb.EmbeddingSetup.from_config(cfg, w)
    dense_model = build_model(cfg.model, cfg.data.max_seqlen)
    model = build_model(cfg.model, cfg.data.max_seqlen, external_tables=True)
    host = make_global_batch(cfg, 6, [6, 4, 0, 5][:w] if w == 4 else [6, 3][:w], first_id=7)
    cost = HSTUCost.from_model_config(cfg.model)
    glt = np.float32(sample_stats(host, cost, task)[:, STAT_LOSS_TOKENS].sum())
    batch = JaxShuffler(mesh, "all2all").shuffle(host, cost, task, shuffler="balanced")
    batch = batch.device_batch.batch
    step = make_sharded_train_step(model, optimizer_d, setup, mesh, donate=False)
    dense_grad = jax.jit(jax.value_and_grad(make_loss_fn(dense_model, mesh), has_aux=True))

    state = init_sharded_state(params, optimizer_d, setup, mesh)
    start = jax.device_get(state.tables)
    ref_tables = {n: params[f"embedding.{n}"] for n in emb.TABLES}
    ref_state = {n: embedding_opt.init_state(optimizer, *ref_tables[n].shape) for n in emb.TABLES}
    touched = {n: _touched(host, emb.TABLE_KEYS[n]) for n in emb.TABLES}
    result = {"world": w, "task": task, "optimizer": optimizer, "sharding": sharding}
    num_steps = 2 if optimizer == "adam" else 1
    for i in range(num_steps):
        # the dense model's gradient at the sharded run's current parameters
        full = full_params(state, setup, mesh)
        (loss_d, _), grads = dense_grad(full, batch, glt, state.rng)
        grads = flax_to_params(grads)
        state, metrics = step(state, batch, glt)
        if i == 0:
            result["loss_rel"] = abs(float(metrics["loss"]) - float(loss_d)) / float(loss_d)

            # as torch: the all-reduced gradients' norm (the tables' with data_parallel)
            def reduced(k):
                return sharding == "data_parallel" or not k.startswith("embedding.")

            norm = float(optax.tree.norm({k: v for k, v in grads.items() if reduced(k)}))
            result["grad_norm_rel"] = abs(float(metrics["grad_norm"]) - norm) / norm
            dense_grads = {k: v for k, v in grads.items() if not k.startswith("embedding.")}
            opt_d = make_optimizer(cfg.train)
            dtree = params_to_flax(dense_params(params))
            upd, _ = opt_d.update(params_to_flax(dense_grads), opt_d.init(dtree), dtree)
            want = flax_to_params(optax.apply_updates(dtree, upd))
            got = flax_to_params(state.params)
            result["dense_err"] = max(_rel(got[k], want[k]) for k in want)
        for n in emb.TABLES:
            t = touched[n]
            g = grads[f"embedding.{n}"][t]
            ref_tables[n], ref_state[n] = embedding_opt.apply(
                optimizer, ref_state[n], ref_tables[n], t, g, cfg.embedding
            )
    end = jax.device_get(state.tables)
    result.update(steps=num_steps, count=int(end["count"]), table_err=0.0, state_err=0.0)
    identical, num_touched, num_untouched = True, 0, 0
    for n in emb.TABLES:
        lay = setup.layout(n)
        mask = np.zeros(lay.padded_rows, bool)
        mask[touched[n]] = True
        num_touched += int(mask.sum())
        num_untouched += int((~mask).sum())
        result["table_err"] = max(
            result["table_err"], _rel(end["weights"][n][: lay.num_rows], ref_tables[n])
        )
        identical &= np.array_equal(end["weights"][n][~mask], start["weights"][n][~mask])
        for f in setup.state_fields:
            result["state_err"] = max(
                result["state_err"], _rel(end[f][n][: lay.num_rows], ref_state[n][f])
            )
            identical &= np.array_equal(end[f][n][~mask], start[f][n][~mask])
    result.update(touched=num_touched, untouched=num_untouched, untouched_identical=bool(identical))
    return result


def _invariance(mesh) -> list:
    """Identity vs balanced (all2all exchange): the same loss and tables after a step."""
    import jax
    import numpy as np

    from hstu.jax_backend import embedding as emb
    from hstu.jax_backend.model import build_model
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.state import init_sharded_state
    from hstu.jax_backend.train_step import make_optimizer, make_sharded_train_step
    from hstu.params import init_params
    from hstu.pipeline import STAT_LOSS_TOKENS, sample_stats
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    cfg = _cfg("model.task=retrieval", "embedding.sharding=row_wise", "embedding.optimizer=adam")
    setup = emb.EmbeddingSetup.from_config(cfg, mesh.size)
    model = build_model(cfg.model, cfg.data.max_seqlen, external_tables=True)
    opt = make_optimizer(cfg.train)
    step = make_sharded_train_step(model, opt, setup, mesh, donate=False)
    state = init_sharded_state(init_params(cfg.model, 0), opt, setup, mesh)
    host = make_global_batch(cfg, 6, [6, 6, 1, 5], first_id=40)
    cost = HSTUCost.from_model_config(cfg.model)
    glt = np.float32(sample_stats(host, cost, "retrieval")[:, STAT_LOSS_TOKENS].sum())
    runs = {}
    for kind, exchange, shuffler in (
        ("identity", "allgather", "identity"),
        ("all2all", "all2all", "balanced"),
    ):
        prep = JaxShuffler(mesh, exchange).shuffle(host, cost, "retrieval", shuffler=shuffler)
        new, metrics = step(state, prep.device_batch.batch, glt)
        runs[kind] = (float(metrics["loss"]), jax.device_get(new.tables), prep.plan.num_moved())
    base_loss, base_tables, _ = runs["identity"]
    out = []
    for kind in ("all2all",):
        loss, tables, moved = runs[kind]
        err = max(
            _rel(a, b)
            for a, b in zip(jax.tree.leaves(tables), jax.tree.leaves(base_tables), strict=True)
        )
        out.append(
            {
                "kind": kind,
                "moved": moved,
                "loss_rel": abs(loss - base_loss) / base_loss,
                "table_err": err,
            }
        )
    return out


def _memory(mesh) -> dict:
    """Temporaries of the compiled step with a 1M-row and a 100M-row item table (abstract
    state: nothing of the table is allocated)."""
    import dataclasses

    import jax
    import numpy as np

    from hstu.jax_backend import embedding as emb
    from hstu.jax_backend.model import build_model
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.state import init_sharded_state
    from hstu.jax_backend.train_step import make_optimizer, make_sharded_train_step
    from hstu.params import init_params
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    cfg = _cfg("embedding.sharding=row_wise", "embedding.optimizer=adam")
    opt = make_optimizer(cfg.train)
    setup = emb.EmbeddingSetup.from_config(cfg, mesh.size)
    state = init_sharded_state(init_params(cfg.model, 0), opt, setup, mesh)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    host = make_global_batch(cfg, 6, [6] * mesh.size, first_id=3)
    cost = HSTUCost.from_model_config(cfg.model)
    prep = JaxShuffler(mesh, "allgather").shuffle(host, cost, "ranking", shuffler="identity")
    temps, fresh = [], []
    for rows in (1_000_000, 100_000_000):
        big = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_items=rows))
        setup = emb.EmbeddingSetup.from_config(big, mesh.size)
        padded = setup.layout("item").padded_rows
        tables = dict(abstract.tables)
        for key in ("weights", *setup.state_fields):
            x = tables[key]["item"]
            grown = jax.ShapeDtypeStruct((padded, *x.shape[1:]), x.dtype, sharding=x.sharding)
            tables[key] = {**tables[key], "item": grown}
        model = build_model(big.model, big.data.max_seqlen, external_tables=True)
        step = make_sharded_train_step(model, opt, setup, mesh)
        args = (dataclasses.replace(abstract, tables=tables), prep.device_batch.batch)
        compiled = step.lower(*args, np.float32(100.0)).compile()
        mem = compiled.memory_analysis()
        temps.append(int(mem.temp_size_in_bytes))
        # outputs not written into a donated input: a new table per step if the donation failed
        fresh.append(int(mem.output_size_in_bytes - mem.alias_size_in_bytes))
    return {"temp_bytes": temps, "fresh_output_bytes": fresh}


def steps_worker(cases: list) -> dict:
    import jax

    from hstu.jax_backend import collectives as col

    meshes = {w: col.make_mesh(jax.devices()[:w]) for w in (1, 2, 4)}
    import time

    out, times = {}, {}
    for key, fn in (
        ("lookup", lambda: _lookup_cases(meshes.__getitem__)),
        ("steps", lambda: [_step_case(meshes[w], *rest) for w, *rest in cases]),
        ("invariance", lambda: _invariance(meshes[4])),
        ("memory", lambda: _memory(meshes[2])),
    ):
        t0 = time.perf_counter()
        out[key] = fn()
        times[key] = round(time.perf_counter() - t0, 1)
    return out | {"times": times}


def resume_worker(out: str) -> dict:
    """Train 4 steps saving step-2 and step-4; resume a copy of step-2; compare; convert."""
    import shutil
    import time

    import numpy as np

    from hstu.convert import convert
    from hstu.jax_backend.convert import read_portable, write_portable
    from hstu.jax_backend.launch import train

    root = Path(out)
    common = [
        "dist.world_size=2",
        "train.checkpoint_every=2",
        "train.log_every=100",
        "embedding.sharding=auto",
        "embedding.optimizer=adam",
        "embedding.weight_decay=0.01",
    ]
    cfg = _cfg(*common, "train.steps=4", f"output_dir={root / 'a'}")
    times = [time.perf_counter()]
    full = train(cfg)
    times.append(time.perf_counter())
    (root / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "a/checkpoints/step-2", root / "b/checkpoints/step-2")
    resumed = train(_cfg(*common, "train.steps=4", "train.resume=true", f"output_dir={root / 'b'}"))
    times.append(time.perf_counter())
    dense = train(_cfg("train.steps=1", "dist.world_size=2", f"output_dir={root / 'd'}"))
    times.append(time.perf_counter())

    def flat(state) -> dict:
        out = {f"params/{k}": v for k, v in state.params.items()}
        out |= {f"mu/{k}": v for k, v in state.adam.mu.items()}
        out |= {f"nu/{k}": v for k, v in state.adam.nu.items()}
        for f in ("sum", "m", "v"):
            out |= {f"{f}/{k}": v for k, v in getattr(state.tables, f).items()}
        counts = (state.step, state.adam.count, state.tables.count, state.data["next_sample"])
        return out | {"counts": np.asarray(counts)}

    def same(a, b) -> list:
        if a.keys() != b.keys():
            return [f"keys: {sorted(a.keys() ^ b.keys())}"]
        return [k for k in a if not np.array_equal(a[k], b[k])]

    a = read_portable(root / "a/checkpoints/step-4", cfg)
    b = read_portable(root / "b/checkpoints/step-4", cfg)
    diff = same(flat(a), flat(b))
    write_portable(a, root / "c", cfg)
    roundtrip = same(flat(a), flat(read_portable(root / "c", cfg)))
    cfg4 = _cfg(*common, "dist.world_size=4", "train.steps=4")  # rows padded for 4 ranks
    convert("jax", "jax", root / "a", root / "w4", cfg4)  # hstu convert: validated, re-padded
    regrid = same(flat(a), flat(read_portable(root / "w4", cfg4)))
    # elastic: the W=2 step-2 checkpoint resumed on 4 ranks (tables re-padded on restore)
    # continues the W=2 run's curve: the same global batches (half as many samples per rank),
    # state and samples
    shutil.copytree(root / "a/checkpoints/step-2", root / "e/checkpoints/step-2")
    half = f"data.batch_size={cfg.data.batch_size // 2}"
    resume4 = ["dist.world_size=4", half, "train.steps=4", "train.resume=true"]
    on_four = train(_cfg(*common, *resume4, f"output_dir={root / 'e'}"))
    return {
        "full_steps": [r["step"] for r in full],
        "full_losses": [r["loss"] for r in full],
        "resumed_steps": [r["step"] for r in resumed],
        "resumed_losses": [r["loss"] for r in resumed],
        "on_four_steps": [r["step"] for r in on_four],
        "on_four_losses": [r["loss"] for r in on_four],
        "state_identical": not diff,
        "state_diff": diff,
        "step0_equals_dense": dense[0]["loss"] == full[0]["loss"],
        "portable": {
            "optimizer": a.tables.optimizer,
            "count": a.tables.count,
            "m_item_shape": list(a.tables.m["embedding.item"].shape),
            "dense_only_adam": not any(k.startswith("embedding.") for k in a.adam.mu),
        },
        "roundtrip_identical": not roundtrip,
        "regrid_identical": not regrid,
        "diffs": [roundtrip, regrid],
        "times": np.diff(times + [time.perf_counter()]).round(1).tolist(),
    }


def probe_worker(out: str) -> dict:
    """Two ranks, 3 steps with and without probes, sharded (row_wise, Adam) and replicated
    (data_parallel, row-wise Adagrad) tables."""
    from hstu.jax_backend.launch import train

    keep = ("loss", "compute_s_before", "compute_s_after", "device_s")
    result = {}
    for sharding, opt in (("row_wise", "adam"), ("data_parallel", "row_wise_adagrad")):
        common = ["dist.world_size=2", "train.steps=3", "train.log_every=100"]
        common += [f"embedding.sharding={sharding}", f"embedding.optimizer={opt}"]
        runs = []
        for probes in (["bench.probe_every=1", "bench.probe_after=1"], []):
            rows = train(
                _cfg(*common, *probes, f"output_dir={Path(out) / sharding / str(len(probes))}")
            )
            runs.append([{k: row[k] for k in keep if k in row} for row in rows])
        result[sharding] = runs
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("HSTU_TEST_DEVICES", "4")))
    jax.devices()  # start now: train(dist.world_size=2) then leaves the device count alone
    sys.path.insert(0, str(REPO))
    result = globals()[sys.argv[1]](**json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
