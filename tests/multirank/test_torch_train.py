"""Torch training on gloo ranks: shuffle invariance of loss and gradients, the CLI end to end,
checkpoint resume, and input errors raised before any collective."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torchrec")

from torch_workers import run_on_ranks  # noqa: E402

from hstu.config import load_config  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.metrics import STEP_FIELDS  # noqa: E402
from hstu.testing import DEMO_CONFIG, make_global_batch  # noqa: E402

WORLD = 4
MODES = (("identity", "allgather"), ("balanced", "allgather"), ("balanced", "all2all"))
CLI_FIELDS = STEP_FIELDS


def _cfg(task: str, *extra: str):
    return load_config(
        DEMO_CONFIG,
        [
            f"model.task={task}",
            "model.rab_time_buckets=8",
            "data.max_history=32",
            f"dist.world_size={WORLD}",
            *extra,
        ],
    )


def _one_step_worker(rank: int, world: int, device: str) -> dict:
    """One training step of the same global batch under every shuffler/exchange."""
    from hstu.pipeline import STAT_LOSS_TOKENS, Balancer, sample_stats
    from hstu.torch_backend.train_step import TorchBackend
    from hstu.workload import HSTUCost

    out = {}
    for task in ("ranking", "retrieval"):
        cfg = _cfg(task)
        batches = make_global_batch(cfg, cfg.data.batch_size, (8, 3, 0, 7)[:world])
        cost = HSTUCost.from_model_config(cfg.model)
        for shuffler, exchange in MODES:
            cfg.balance.exchange = exchange
            backend = TorchBackend(cfg, rank, world, device)
            balancer = Balancer(backend, shuffler, overlap=False)
            local = [batches[rank]]
            device_batch = backend.to_device(local)
            prepared = balancer.phase2(
                *balancer.phase1(device_batch, sample_stats(local, cost, task))
            )
            handle = backend.forward_backward(
                prepared.device_batch,
                int(prepared.stats[:, STAT_LOSS_TOKENS].sum()),
                prepared.stats,
            )
            grads = backend.grads()
            metrics = backend.fetch_metrics(backend.optimizer_step(handle))
            out[(task, shuffler, exchange)] = {
                "metrics": metrics,
                "grads": grads,
                "moved": prepared.plan.num_moved(),
            }
    return out


def _check_invariance(results: list[dict], world: int) -> None:
    for task in ("ranking", "retrieval"):
        ref = results[0][(task, "identity", "allgather")]
        assert np.isfinite(ref["metrics"]["loss"]) and ref["metrics"]["loss"] > 0
        for mode in MODES[1:]:
            got = results[0][(task, *mode)]
            assert got["moved"] > 0, "the balanced plan must move samples for this test"
            for key, value in ref["metrics"].items():
                assert got["metrics"][key] == pytest.approx(value, rel=1e-5), (task, mode, key)
            assert set(got["grads"]) == set(ref["grads"])
            for name, g in ref["grads"].items():
                scale = float(np.abs(g).max()) or 1.0
                np.testing.assert_allclose(
                    got["grads"][name],
                    g,
                    rtol=1e-5,
                    atol=1e-6 * scale,
                    err_msg=f"{task} {mode} {name}",
                )
        # gradients are all-reduced: every rank holds the same ones
        for rank in range(1, world):
            for name, g in ref["grads"].items():
                np.testing.assert_array_equal(results[rank][(task, *MODES[0])]["grads"][name], g)


@pytest.mark.multirank
def test_identity_and_balanced_give_same_loss_and_gradients():
    _check_invariance(run_on_ranks(_one_step_worker, WORLD), WORLD)


@pytest.mark.gpu
@pytest.mark.multirank
def test_nccl_identity_and_balanced_give_same_loss_and_gradients():
    import torch

    world = min(WORLD, torch.cuda.device_count())
    if world < 2:
        pytest.skip("needs 2 GPUs for NCCL ranks")
    _check_invariance(run_on_ranks(_one_step_worker, world, device="cuda"), world)


def _table_rows_worker(rank: int, world: int, device: str) -> dict:
    """One step of the same global batch, the tables' gradients reduced over the rows the
    ranks looked up (the pipeline's stats bound them) and over the whole tables (no stats);
    with the recipe's dense tables (AdamW) and with data_parallel ones (Adam on their touched
    rows, which then reads the reduced rows only)."""
    from hstu.pipeline import STAT_LOSS_TOKENS, Balancer, sample_stats
    from hstu.torch_backend.train_step import TorchBackend
    from hstu.workload import HSTUCost

    out = {}
    for task, tables in (("ranking", "none"), ("retrieval", "none"), ("ranking", "adam")):
        extra = ["embedding.sharding=data_parallel", "embedding.optimizer=adam"]
        cfg = _cfg(task, *(extra if tables == "adam" else []))
        batches = make_global_batch(cfg, cfg.data.batch_size, (8, 3, 0, 7)[:world])
        cost = HSTUCost.from_model_config(cfg.model)
        for bounded in (True, False):
            backend = TorchBackend(cfg, rank, world, device)
            balancer = Balancer(backend, "identity", overlap=False)
            local = [batches[rank]]
            prepared = balancer.phase2(
                *balancer.phase1(backend.to_device(local), sample_stats(local, cost, task))
            )
            glt = int(prepared.stats[:, STAT_LOSS_TOKENS].sum())
            stats = prepared.stats if bounded else None
            handle = backend.forward_backward(prepared.device_batch, glt, stats)
            grads = backend.grads()
            metrics = backend.fetch_metrics(backend.optimizer_step(handle))
            state = {}
            if backend.tables is not None:  # the tables and Adam's moments after the update
                weights, moments = backend.tables.checkpoint_state()
                state = {n: x.cpu().numpy().copy() for n, x in {**weights, **moments}.items()}
            out[(task, tables, bounded)] = {
                "grads": grads,
                "rows": dict(backend.row_reduce.last_rows),
                "norm": metrics["grad_norm"],
                "state": state,
                "looked_up": sorted(
                    {
                        int(i)
                        for b in batches
                        for k in ("item", "candidate", "negative")
                        if k in b.lengths
                        for i in b.values[k]
                    }
                ),  # fmt: skip
            }
    return out


@pytest.mark.multirank
def test_table_gradients_reduced_over_the_looked_up_rows_equal_the_whole_reduction():
    results = run_on_ranks(_table_rows_worker, WORLD)
    num_items = _cfg("ranking").model.num_items
    for task, tables in (("ranking", "none"), ("retrieval", "none"), ("ranking", "adam")):
        rows = results[0][(task, tables, True)]
        whole = results[0][(task, tables, False)]
        # the item table's reduction carried part of the table; the small tables went whole
        assert rows["rows"]["embedding.item"] < num_items, rows["rows"]
        assert whole["rows"]["embedding.item"] == num_items
        assert whole["rows"]["embedding.action"] == rows["rows"]["embedding.action"]
        g = rows["grads"]["embedding.item"]
        touched = np.flatnonzero(np.abs(g).sum(axis=1))
        assert set(touched) <= set(rows["looked_up"]) and len(touched) > 0
        for name, ref in whole["grads"].items():
            np.testing.assert_allclose(
                rows["grads"][name], ref, rtol=1e-6, atol=1e-7 * (np.abs(ref).max() or 1.0),
                err_msg=f"{task} {tables} {name}",
            )  # fmt: skip
        assert rows["norm"] == pytest.approx(whole["norm"], rel=1e-6)
        # Adam from the reduced rows against Adam over the dense gradient: the same update
        assert set(rows["state"]) == set(whole["state"])
        for name, ref in whole["state"].items():
            np.testing.assert_allclose(
                rows["state"][name], ref, rtol=1e-6, atol=1e-9, err_msg=f"{task} {name}"
            )
        for rank in range(1, WORLD):  # every rank holds the same sums
            for name, ref in rows["grads"].items():
                got = results[rank][(task, tables, True)]["grads"][name]
                np.testing.assert_array_equal(got, ref)
    # the data_parallel tables' Adam state exists and moved where rows were looked up
    state = results[0][("ranking", "adam", True)]["state"]
    assert state and np.abs(state["embedding.item.m"]).sum() > 0


STEP_GRAPH_CASES = (("ranking", "none"), ("retrieval", "none"), ("ranking", "adam"))


def _step_graphs_worker(rank: int, world: int, device: str, cases=STEP_GRAPH_CASES) -> dict:
    """Four steps from the W > 1 step graphs (uncaptured on the CPU: the padded step each graph
    would replay, then the collectives) and from the eager step. Rank 1's first batch holds no
    sample (no graph: the padded step uncaptured, while rank 0 replays); with two graphs
    allowed, a rank whose new shape has none runs uncaptured too; the last step has a sample
    past the step graphs' length bound, so every rank takes the eager step."""
    import torch

    from hstu.capacity import CapacityPolicy
    from hstu.pipeline import STAT_LOSS_TOKENS, Balancer, sample_stats
    from hstu.torch_backend import step_graphs
    from hstu.torch_backend.train_step import TorchBackend
    from hstu.workload import HSTUCost

    step_graphs.MAX_GRAPHS = 2
    out = {}
    for task, tables in cases:
        extra = []
        if tables == "adam":
            extra += ["embedding.sharding=data_parallel", "embedding.optimizer=adam"]
            extra += ["embedding.lr=0.01", "embedding.weight_decay=0.1"]
        if device != "cpu":  # the captured graphs, with the attention kernel
            extra += ["model.attention=kernel", "train.cuda_graphs=true"]
        cfg = _cfg(task, "model.dropout=0.0", "train.weight_decay=0.1", "dist.world_size=2", *extra)
        cost = HSTUCost.from_model_config(cfg.model)
        steps = [make_global_batch(cfg, cfg.data.batch_size, real, first_id=50 * i)
                 for i, real in enumerate(((8, 0), (2, 8), (8, 3), (3, 5)))]  # fmt: skip
        for graphed in (False, True):
            torch.manual_seed(0)
            backend = TorchBackend(cfg, rank, world, device)
            if graphed:
                policy = CapacityPolicy((64, 128, 256, 512))
                backend.use_cuda_graphs(policy, capture=device != "cpu")
            balancer = Balancer(backend, "identity", overlap=False)
            metrics = []
            for i, batches in enumerate(steps):
                local = [batches[rank]]
                prepared = balancer.phase2(
                    *balancer.phase1(backend.to_device(local), sample_stats(local, cost, task))
                )
                if graphed and i == 3:
                    backend.step_graphs.max_seqlen = 8  # a sample past it: the eager step
                glt = int(prepared.stats[:, STAT_LOSS_TOKENS].sum())
                handle = backend.forward_backward(prepared.device_batch, glt, prepared.stats)
                metrics.append(backend.fetch_metrics(backend.optimizer_step(handle)))
            graphs = backend.step_graphs
            out[(task, tables, graphed)] = {
                "metrics": metrics,
                "params": backend.model.export_params(),
                "graphs": None if graphs is None else [graphs.num_graphs, graphs.eager_steps],
            }
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(
    "case",
    # each case is ~30 s of two gloo ranks on 2 cores: retrieval and data_parallel Adam run in
    # the slow tier (and all three on NCCL below)
    [
        pytest.param(
            c,
            id="-".join(c),
            marks=[pytest.mark.slow] if c[0] == "retrieval" or c[1] == "adam" else [],
        )
        for c in STEP_GRAPH_CASES
    ],
)
def test_step_graphs_at_two_ranks_train_as_the_eager_step(case):
    """The W > 1 step graphs' collectives after the replay (the buffer's all-reduce, the item
    table over the rows some rank looked up) give the eager step's losses, metrics, gradient
    norms and parameters, on every rank; the eager fallback keeps every rank on one path."""
    _check_step_graphs(run_on_ranks(_step_graphs_worker, 2, (case,)))


@pytest.mark.gpu
@pytest.mark.multirank
def test_nccl_captured_step_graphs_at_two_ranks_train_as_the_eager_step():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for NCCL ranks")
    _check_step_graphs(run_on_ranks(_step_graphs_worker, 2, device="cuda"))


def _check_step_graphs(results: list[dict]) -> None:
    lr = _cfg("ranking").train.lr
    for key in [k for k in results[0] if not k[2]]:
        want, got = results[0][key], results[0][(*key[:2], True)]
        counts = [r[(*key[:2], True)]["graphs"] for r in results]
        # rank 0: graphs for its first two shapes, its third uncaptured; rank 1: none for its
        # empty batch; both: the last step eager
        assert counts[0] == [2, 2] and counts[1][1] >= 2, (key, counts)
        # the graphed steps count every rank's graphs; the eager one adds the stack's
        assert got["metrics"][2]["num_compiles"] == counts[0][0] + counts[1][0], key
        for w, g in zip(want["metrics"], got["metrics"], strict=True):
            for name in ("loss", "grad_norm", *(k for k in w if k.startswith(("hr", "ndcg")))):
                assert g[name] == pytest.approx(w[name], rel=1e-4, abs=1e-6), (key, name)
        for name, value in want["params"].items():
            # AdamW magnifies rounding-sized differences of near-zero gradients up to a step
            assert np.abs(got["params"][name] - value).max() < 4 * 0.05 * lr, (key, name)
            other = results[1][(*key[:2], True)]["params"][name]  # every rank holds the same
            np.testing.assert_array_equal(other, got["params"][name], err_msg=f"{key} {name}")


def _understated_worker(rank: int, world: int, device: str) -> list[str]:
    """Stats that understate the step's lookups (another batch's): an error on every rank, at
    the same point, before the tables' reduction; in the eager step and in the step graphs'."""
    from hstu.capacity import CapacityPolicy
    from hstu.pipeline import NUM_FIXED_STATS, STAT_LOSS_TOKENS, Balancer, sample_stats
    from hstu.torch_backend import grad_sync
    from hstu.torch_backend.train_step import TorchBackend
    from hstu.workload import HSTUCost

    grad_sync.ROW_GRANULE = 8  # a bound this small is below the rows the batch marks
    cfg = _cfg("ranking")
    batches = make_global_batch(cfg, cfg.data.batch_size, (8, 3, 0, 7)[:world])
    messages = []
    for graphed in (False, True):
        backend = TorchBackend(cfg, rank, world, device)
        if graphed:
            backend.use_cuda_graphs(CapacityPolicy((256, 512)), capture=False)
        local = [batches[rank]]
        cost = HSTUCost.from_model_config(cfg.model)
        balancer = Balancer(backend, "identity", overlap=False)
        prepared = balancer.phase2(
            *balancer.phase1(backend.to_device(local), sample_stats(local, cost, "ranking"))
        )
        stats = prepared.stats.copy()
        for key in ("item", "candidate"):
            stats[:, NUM_FIXED_STATS + local[0].keys.index(key)] = 0
        glt = int(stats[:, STAT_LOSS_TOKENS].sum())
        try:
            backend.forward_backward(prepared.device_batch, glt, stats)
            messages.append("no error")
        except RuntimeError as e:
            messages.append(str(e))
    return messages


@pytest.mark.multirank
def test_stats_that_understate_the_lookups_fail_on_every_rank():
    for messages in run_on_ranks(_understated_worker, 2):
        assert len(messages) == 2  # the eager step, then the step graphs'
        for message in messages:
            assert "embedding.item: more rows looked up than the gathered stats allow" in message


@pytest.mark.multirank
def test_cli_trains_two_ranks_end_to_end(tmp_path, capsys):
    from hstu.cli import main

    out = tmp_path / "run"
    argv = [
        "train",
        "--backend",
        "torch",
        "--config",
        str(DEMO_CONFIG),
        "train.steps=3",
        "dist.world_size=2",
        f"output_dir={out}",
    ]
    assert main(argv) == 0
    assert (out / "config.yaml").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for field in CLI_FIELDS:
            assert field in row, field
        assert np.isfinite(row["loss"]) and len(row["rank_workloads_after"]) == 2
    assert "imbalance before shuffle" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.multirank
def test_cli_trains_on_nccl_like_on_gloo(tmp_path):
    import torch

    from hstu.torch_backend.launch import train

    world = min(2, torch.cuda.device_count())
    rows = {}
    for device in ("cpu", "cuda"):
        cfg = load_config(
            DEMO_CONFIG,
            [
                "train.steps=3",
                f"dist.world_size={world}",
                f"dist.device={device}",
                f"output_dir={tmp_path / device}",
            ],
        )
        rows[device] = train(cfg)
    for a, b in zip(rows["cpu"], rows["cuda"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["global_tokens"] == a["global_tokens"]


def test_checkpoint_resume_continues_the_same_run(tmp_path):
    from hstu.torch_backend.checkpoint import complete_steps
    from hstu.torch_backend.launch import train

    def cfg(out, *extra):
        return load_config(
            DEMO_CONFIG, ["dist.world_size=1", f"output_dir={out}", "train.log_every=100", *extra]
        )

    full = train(cfg(tmp_path / "full", "train.steps=6"))
    first = train(
        cfg(
            tmp_path / "ckpt",
            "train.steps=4",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=1",
        )
    )
    assert complete_steps(tmp_path / "ckpt" / "checkpoints") == [4]
    resumed = train(cfg(tmp_path / "ckpt", "train.steps=6", "train.resume=true"))
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    assert [r["step"] for r in resumed] == [4, 5]
    for a, b in zip(full[4:], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["global_tokens"] == a["global_tokens"]


def test_a_batch_of_another_layout_fails_before_any_collective():
    # (ids out of their tables fail earlier, on the host: tests/unit/test_trainer.py)
    from hstu.torch_backend.train_step import TorchBackend

    cfg = _cfg("ranking")
    backend = TorchBackend(cfg, 1, WORLD, "cpu")  # no process group exists: nothing may hang
    backend.to_device(make_global_batch(cfg, cfg.data.batch_size, (4,)))
    wrong_size = make_global_batch(cfg, cfg.data.batch_size + 1, (4,))[0]
    with pytest.raises(HSTUError, match="rank 1: batch_size"):
        backend.to_device([wrong_size])
    missing = make_global_batch(cfg, cfg.data.batch_size, (4,))[0]
    del missing.lengths["label"], missing.values["label"]
    with pytest.raises(HSTUError, match="rank 1: keys"):
        backend.to_device([missing])


def test_kernel_attention_on_cpu_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from hstu.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = [
        "train",
        "--backend",
        "torch",
        "--config",
        str(DEMO_CONFIG),
        "train.steps=1",
        "dist.world_size=1",
        "model.attention=kernel",
        "dist.device=cpu",
        f"output_dir={tmp_path}",
    ]
    assert main(argv) == 2
    assert "model.attention=kernel needs a CUDA device" in capsys.readouterr().err


@pytest.mark.multirank
def test_torchrun_prints_and_records_the_world_it_runs_with(tmp_path):
    import subprocess
    import sys

    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *("-m", "hstu.cli", "train", "--backend", "torch", "--config", "demo"),
        *("train.steps=2", "dist.world_size=4", f"output_dir={tmp_path}"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("# resolved config") == 1  # rank 0 only
    assert "world_size: 2" in proc.stdout and "world_size: 4" not in proc.stdout
    assert load_config(tmp_path / "config.yaml").dist.world_size == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [len(r["rank_workloads_before"]) for r in rows] == [2, 2]


def _graph_count_worker(rank: int, world: int, device: str) -> list[int]:
    """Three steps with the stack padded per rank (graphs without capture, as on CPU): rank 1
    reaches a second capacity at the third step, rank 0 never does."""
    from hstu.capacity import CapacityPolicy
    from hstu.pipeline import STAT_LOSS_TOKENS, STAT_TOKENS, sample_stats
    from hstu.torch_backend.graphs import GraphedStack
    from hstu.torch_backend.train_step import TorchBackend
    from hstu.workload import HSTUCost

    cfg = _cfg("ranking", "dist.world_size=2")
    cost = HSTUCost.from_model_config(cfg.model)
    steps = [make_global_batch(cfg, cfg.data.batch_size, real, first_id=100 * i)
             for i, real in enumerate(((1, 1), (1, 1), (1, 4)))]  # fmt: skip
    stats = [[sample_stats([b], cost, "ranking") for b in step] for step in steps]
    tokens = [[int(s[:, STAT_TOKENS].sum()) for s in step] for step in stats]
    small = max(max(t) for t in tokens[:2] + [[tokens[2][0]]])
    assert tokens[2][1] > small, tokens  # rank 1's third batch needs the larger capacity
    backend = TorchBackend(cfg, rank, world, device)
    policy = CapacityPolicy((small, tokens[2][1]))
    backend.model.graphed = GraphedStack(backend.model, policy, cfg.data.max_seqlen, capture=False)
    seen = []
    for step, step_stats in zip(steps, stats, strict=True):
        glt = sum(int(s[:, STAT_LOSS_TOKENS].sum()) for s in step_stats)
        handle = backend.forward_backward(backend.to_device([step[rank]]), glt)
        seen.append(backend.fetch_metrics(backend.optimizer_step(handle))["num_compiles"])
    return seen


@pytest.mark.multirank
def test_graph_captures_are_counted_over_all_ranks():
    """A step in which any rank captures a graph stalls every rank: every rank's metrics count
    the captures of all ranks, so the benchmark medians leave that step out everywhere."""
    results = run_on_ranks(_graph_count_worker, 2)
    assert results[0] == results[1] == [2, 2, 3]
