"""Sharded embedding tables in the torch backend (gloo, 2 ranks): every `embedding.sharding`
against the replicated model and the numpy reference of the tables' optimizer, shuffle
invariance, the collective order, and checkpoint resume.

Small tables whose row counts do not divide by the world size (row-wise shards are uneven)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchrec")

from torch_workers import run_on_ranks  # noqa: E402

from hstu import embedding_opt  # noqa: E402
from hstu.config import load_config  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.testing import DEMO_CONFIG, make_global_batch  # noqa: E402

WORLD = 2
SHARDINGS = ("table_wise", "row_wise", "data_parallel", "auto")
# ranking: item / action / contextual tables; retrieval: the item table also serves negatives
TASKS = ("ranking", "retrieval")
# the features each table looks up (docs/MODEL.md token table)
FEATURES = {
    "item": ("item", "candidate", "negative"),
    "action": ("action",),
    "contextual": ("contextual",),
}
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "reduce_scatter",
    "reduce_scatter_tensor",
)


def _cfg(task: str, sharding: str, *extra: str):
    return load_config(
        DEMO_CONFIG,
        [
            f"model.task={task}",
            "model.num_items=37",  # odd: uneven row-wise shards at W=2
            "model.num_actions=5",
            "model.num_contextual_ids=11",
            "model.embedding_dim=16",
            "model.num_layers=1",
            "model.num_negatives=4",
            "data.max_history=16",
            "data.batch_size=4",
            f"dist.world_size={WORLD}",
            f"embedding.sharding={sharding}",
            "embedding.lr=0.05",
            *extra,
        ],
    )


def _record_collectives(log: list):
    """Wrap torch.distributed's collectives: every call appends (name, group name)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            log.append((name, getattr(group, "group_name", "default") if group else "default"))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    return lambda: [setattr(dist, n, f) for n, f in originals.items()]


def _touched(batches, keys) -> np.ndarray:
    ids = [np.asarray(b.values[k]) for b in batches for k in keys if k in b.values]
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)


def _one_step_worker(
    rank: int, world: int, device: str, optimizer: str = "row_wise_adagrad", shardings=SHARDINGS
) -> dict:
    """Per task, sharding and shuffler: one step of the same global batch; the loss, whole
    tables before / after and their optimizer state, the collectives issued."""
    from hstu.params import init_params
    from hstu.pipeline import STAT_LOSS_TOKENS, Balancer, sample_stats
    from hstu.torch_backend.sharding import gather_tables
    from hstu.torch_backend.train_step import TorchBackend
    from hstu.workload import HSTUCost

    out = {}
    for task in TASKS:
        for sharding in ("none", *shardings):
            for shuffler in ("identity", "balanced"):
                if sharding == "none" and shuffler == "balanced":
                    continue
                cfg = _cfg(
                    task,
                    sharding,
                    f"embedding.optimizer={optimizer}",
                    f"dist.device={device.split(':')[0]}",  # the config names the kind only
                )
                batches = make_global_batch(cfg, cfg.data.batch_size, (4, 2))
                log: list = []
                restore = _record_collectives(log)
                try:
                    backend = TorchBackend(cfg, rank, world, device)
                    balancer = Balancer(backend, shuffler, overlap=False)
                    local = [batches[rank]]
                    cost = HSTUCost.from_model_config(cfg.model)
                    prepared = balancer.phase2(
                        *balancer.phase1(backend.to_device(local), sample_stats(local, cost, task))
                    )
                    handle = backend.forward_backward(
                        prepared.device_batch,
                        int(prepared.stats[:, STAT_LOSS_TOKENS].sum()),
                        prepared.stats,
                    )
                    grads = backend.grads()
                    metrics = backend.fetch_metrics(backend.optimizer_step(handle))
                    shapes = {f"embedding.{t}": (0, 0) for t in FEATURES}
                    params = init_params(cfg.model, cfg.train.seed)
                    shapes = {n: params[n].shape for n in shapes}
                    tables = (
                        gather_tables(backend.tables, shapes) if backend.tables is not None else {}
                    )
                finally:
                    restore()
                out[(task, sharding, shuffler)] = {
                    "loss": metrics["loss"],
                    "grads": {n: g for n, g in grads.items() if n.startswith("embedding.")},
                    "tables": tables,
                    "init": {n: params[n] for n in shapes},
                    "touched": {
                        f"embedding.{t}": _touched(batches, keys) for t, keys in FEATURES.items()
                    },
                    "collectives": log,
                    "plan": backend.tables.sharding_types()
                    if getattr(backend.tables, "kind", "") == "fused"
                    else {},
                    "kernels": backend.tables.compute_kernels()
                    if getattr(backend.tables, "kind", "") == "fused"
                    else {},
                    "moved": prepared.plan.num_moved(),
                }
    return out


@pytest.fixture(scope="module")
def one_step():
    return run_on_ranks(_one_step_worker, WORLD)


@pytest.mark.multirank
def test_every_sharding_matches_the_replicated_loss_and_the_reference_update(one_step):
    _check_reference_update(one_step, "row_wise_adagrad", SHARDINGS)
    plans = one_step[0][("ranking", "row_wise", "identity")]["plan"]
    assert set(plans.values()) == {"row_wise"}
    assert set(one_step[0][("ranking", "table_wise", "identity")]["plan"].values()) == {
        "table_wise"
    }


@pytest.mark.multirank
def test_data_parallel_adam_updates_the_ranks_touched_rows_as_the_reference():
    """Replicated tables with Adam (no fbgemm kernel: ours, so on gloo too): every rank's
    marks combined, the reference update on the union, every other row bit-identical, the
    same collectives on both ranks."""
    results = run_on_ranks(_one_step_worker, WORLD, "adam", ("data_parallel",))
    _check_reference_update(results, "adam", ("data_parallel",))
    reduce = ("all_reduce", "default")
    for key, r in results[0].items():
        assert r["collectives"] == results[1][key]["collectives"], key
        if key[1] == "data_parallel":  # as replicated: the marks' MAX, the buckets, the tables
            none = results[0][(key[0], "none", "identity")]["collectives"].count(reduce)
            assert r["collectives"].count(reduce) == none, key


@pytest.mark.gpu
@pytest.mark.multirank
def test_adam_on_nccl_matches_the_reference_update():
    import torch

    world = min(WORLD, torch.cuda.device_count())
    shardings = ("table_wise", "row_wise")
    results = run_on_ranks(_one_step_worker, world, "adam", shardings, device="cuda")
    _check_reference_update(results, "adam", shardings)
    for key, r in results[0].items():  # the tables in GPU memory (planned against its size)
        if r["kernels"]:
            assert set(r["kernels"].values()) == {"fused"}, (key, r["kernels"])


def _check_reference_update(one_step, optimizer: str, shardings) -> None:
    ecfg = _cfg("ranking", "row_wise", f"embedding.optimizer={optimizer}").embedding
    for task in TASKS:
        ref = one_step[0][(task, "none", "identity")]
        for sharding in shardings:
            got = one_step[0][(task, sharding, "identity")]
            # same init, same lookups: the step-0 loss is the replicated model's, exactly
            assert got["loss"] == ref["loss"], (task, sharding)
            for name, (table, state) in got["tables"].items():
                ids = got["touched"][name]
                grads = ref["grads"][name][ids]  # g_r: the replicated model's reduced gradient
                init = embedding_opt.init_state(optimizer, *table.shape)
                want, want_state = embedding_opt.apply(
                    optimizer, init, got["init"][name], ids, grads, ecfg
                )
                # g_r is summed in another order than the replicated all-reduce: a tolerance
                # of 2e-4 of the largest first-step move (lr per element)
                np.testing.assert_allclose(
                    table, want, rtol=1e-5, atol=2e-4 * ecfg.lr, err_msg=f"{task} {sharding} {name}"
                )
                want_s = (
                    want_state["sum"][:, None]
                    if optimizer == "row_wise_adagrad"
                    else np.concatenate([want_state["m"], want_state["v"]], axis=1)
                )
                np.testing.assert_allclose(state, want_s, rtol=1e-4, atol=1e-9, err_msg=name)
                untouched = np.setdiff1d(np.arange(table.shape[0]), ids)
                np.testing.assert_array_equal(table[untouched], got["init"][name][untouched])


@pytest.mark.multirank
def test_identity_and_balanced_shuffles_give_the_same_step(one_step):
    for task in TASKS:
        for sharding in SHARDINGS:
            a = one_step[0][(task, sharding, "identity")]
            b = one_step[0][(task, sharding, "balanced")]
            assert b["moved"] > 0, "the balanced plan must move samples for this test"
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (task, sharding)
            for name, (table, _) in a["tables"].items():
                np.testing.assert_allclose(b["tables"][name][0], table, rtol=1e-5, atol=1e-6)


@pytest.mark.multirank
def test_the_collective_order_is_the_same_on_every_rank(one_step):
    for key, result in one_step[0].items():
        other = one_step[1][key]["collectives"]
        assert result["collectives"] == other, key
        if key[1] in ("table_wise", "row_wise", "auto"):  # the embedding all-to-alls ran
            groups = {g for name, g in result["collectives"] if name == "all_to_all_single"}
            assert groups and "default" not in groups, key


def test_configs_this_backend_cannot_run_fail_before_any_rank_starts(tmp_path):
    from hstu.torch_backend.launch import train

    cases = {
        "embedding.optimizer=adam runs on CUDA only": ["embedding.optimizer=adam"],
    }
    for match, extra in cases.items():
        with pytest.raises(HSTUError, match=match):
            train(_cfg("ranking", "row_wise", f"output_dir={tmp_path}", "dist.device=cpu", *extra))


@pytest.mark.multirank
@pytest.mark.slow  # ~20 s: `make test-slow`
def test_probes_time_sharded_tables_and_leave_training_alone(tmp_path):
    """`bench.probe_every` with sharded tables: every rank's forward + backward from its
    looked-up rows (TorchRec's fused backward would update the tables: the probe's backward
    ends at the rows), and a run probed every step trains exactly as one never probed."""
    from hstu.torch_backend.launch import train

    for sharding, world, opt in (
        ("row_wise", WORLD, "row_wise_adagrad"),
        ("data_parallel", 1, "adam"),
    ):
        common = ["train.steps=3", "train.log_every=100", "dist.device=cpu"]
        common += [f"dist.world_size={world}", f"embedding.optimizer={opt}"]
        probes = ["bench.probe_every=1", "bench.probe_after=1"]
        probed = train(
            _cfg("retrieval", sharding, *common, *probes, f"output_dir={tmp_path / 'a'}")
        )
        plain = train(_cfg("retrieval", sharding, *common, f"output_dir={tmp_path / 'b'}"))
        assert [r["loss"] for r in probed] == [r["loss"] for r in plain], sharding  # bit-exact
        assert ["compute_s_after" in r for r in probed] == [False, True, True], sharding
        for r in probed[1:]:
            assert len(r["compute_s_before"]) == len(r["compute_s_after"]) == world
            assert all(t > 0 for t in r["compute_s_before"] + r["compute_s_after"]), r


@pytest.mark.multirank
@pytest.mark.slow  # ~15 s: `make test-slow`
def test_checkpoint_resume_continues_bit_exactly_and_on_another_world_size(tmp_path):
    from hstu.torch_backend.launch import train

    def cfg(out, sharding, *extra):
        return _cfg(
            "retrieval",
            sharding,
            f"output_dir={out}",
            "train.log_every=100",
            "dist.device=cpu",
            *extra,
        )

    # row_wise at W=2 (spawned ranks); data_parallel at W=1 (in-process: quicker), with
    # row-wise Adagrad and with Adam (its moments and its t on the device resumed)
    for sharding, world, opt in (
        ("row_wise", WORLD, "row_wise_adagrad"),
        ("data_parallel", 1, "row_wise_adagrad"),
        ("data_parallel", 1, "adam"),
    ):
        ws, o = f"dist.world_size={world}", f"embedding.optimizer={opt}"
        full = train(cfg(tmp_path / f"{sharding}-{opt}-full", sharding, "train.steps=4", ws, o))
        ckpt = tmp_path / (f"{sharding}-ckpt" if opt == "row_wise_adagrad" else f"{opt}-ckpt")
        train(cfg(ckpt, sharding, "train.steps=2", "train.checkpoint_every=2", ws, o))
        resumed = train(cfg(ckpt, sharding, "train.steps=4", "train.resume=true", ws, o))
        assert [r["step"] for r in resumed] == [2, 3]
        for a, b in zip(full[2:], resumed, strict=True):
            assert b["loss"] == a["loss"], (sharding, opt)  # bit-exact
        if sharding == "row_wise":
            full_row_wise = full
    # elastic: the row-wise checkpoint of 2 ranks (step-2) into 1 rank taking the same global
    # batch, table-wise: the same state and samples, so the 2-rank run's step-2 loss
    one = train(
        cfg(
            tmp_path / "row_wise-ckpt",
            "table_wise",
            "train.steps=3",
            "train.resume=true",
            "dist.world_size=1",
            f"data.batch_size={WORLD * 4}",
        )
    )
    assert [r["step"] for r in one] == [2]
    assert one[0]["loss"] == pytest.approx(full_row_wise[2]["loss"], rel=1e-5)
    # hstu convert's torch half: the 2-rank row-wise checkpoint as whole tables and back,
    # resumed on 1 rank: the same step-2 loss again
    from hstu.convert import describe
    from hstu.torch_backend.convert import read_portable, write_portable

    one_cfg = cfg(
        tmp_path / "converted",
        "row_wise",
        "train.steps=3",
        "train.resume=true",
        "dist.world_size=1",
        f"data.batch_size={WORLD * 4}",
    )
    state = read_portable(tmp_path / "row_wise-ckpt", one_cfg).validate(one_cfg.model)
    assert state.tables.optimizer == "row_wise_adagrad" and state.tables.count == 2
    assert set(state.adam.mu) == {n for n in state.params if not n.startswith("embedding.")}
    assert "sharded tables' row_wise_adagrad state (count 2)" in describe(state)
    write_portable(state, tmp_path / "converted", one_cfg)
    again = train(one_cfg)
    assert again[0]["loss"] == pytest.approx(full_row_wise[2]["loss"], rel=1e-5)
    with pytest.raises(HSTUError, match="embedding.sharding=none"):
        write_portable(state, tmp_path / "other", cfg(tmp_path / "other", "none"))
