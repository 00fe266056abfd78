"""Multi-device JAX workers, run in a fresh interpreter with N host devices.

    python tests/multirank/jax_workers.py <worker> <json kwargs>

The host device count must be set before JAX initialises, hence a subprocess per run. Each
worker prints one line `RESULT <json>` last; `run_worker` returns that JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(tempfile.gettempdir()) / f"hstu-jax-test-cache-{os.getuid()}"


def start_worker(name: str, devices: int, env: dict | None = None, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), name, json.dumps(kwargs)]
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", HSTU_TEST_DEVICES=str(devices))
    # Workers compile the same programs again and again (run, kill, resume ...): share
    # compiled executables through JAX's persistent cache.
    full_env.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
    full_env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    full_env.update(env or {})
    return subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish_worker(proc: subprocess.Popen, name: str = "worker", timeout: float = 240) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"worker {name} failed (exit {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def run_worker(name: str, devices: int, timeout: float = 240, **kwargs) -> dict:
    return finish_worker(start_worker(name, devices, **kwargs), name, timeout)


# ------------------------------------------------------------------------------ workers
def _cfg(task: str, *extra: str):
    from hstu.config import load_config
    from hstu.testing import DEMO_CONFIG

    return load_config(DEMO_CONFIG, [f"model.task={task}", *extra])


def _extra_fields(batches, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    for b in batches:
        real = np.arange(b.batch_size) < b.actual_batch_size
        b.dense["score"] = np.where(real[:, None], rng.normal(size=(b.batch_size, 3)), 0).astype(
            np.float32
        )
        b.dense["flag"] = real & (rng.random(b.batch_size) < 0.5)
        b.values["label"] = b.values["label"].astype(np.int32)
    return batches


def _plans(batches, world: int, seed: int):
    """Balanced (real workloads), identity, random workloads and 'everyone moves' plans."""
    import numpy as np

    from hstu.batch import real_mask
    from hstu.shuffle_plan import ShufflePlan, identity_plan, make_plan
    from hstu.workload import HSTUCost

    real = real_mask(batches)
    work = np.concatenate([HSTUCost(8, 1, 1, 4, 4).batch_flops(b) for b in batches])
    rng = np.random.default_rng(seed)
    b = batches[0].batch_size
    rev = np.stack([np.arange(b) + (world - 1 - r) * b for r in range(world)])
    order = np.argsort(~real[rev], axis=1, kind="stable")  # real rows first
    rev = np.take_along_axis(rev, order, axis=1)
    return {
        "balanced": make_plan(work, real, world),
        "identity": identity_plan(real, world),
        "random": make_plan(np.where(real, rng.integers(1, 10**6, real.size), 0), real, world),
        "reverse": ShufflePlan(world, b, rev, real[rev].sum(axis=1)),
    }


def exchange(cases: list, num_keys_check: int = 12) -> dict:
    """allgather == all2all == exchange_reference, per case and plan; collective counts."""
    import jax
    import numpy as np

    from hstu.batch import JaggedBatch
    from hstu.jax_backend import batch as jb
    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.shuffler import JaxShuffler, plan_exchange
    from hstu.pipeline import sample_stats
    from hstu.shuffle_plan import exchange_reference
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    world = jax.device_count()
    mesh = col.make_mesh(jax.devices())
    shufflers = {k: JaxShuffler(mesh, k, host_exchange=False) for k in ("allgather", "all2all")}
    failures, info = [], []
    for i, (task, real) in enumerate(cases):
        cfg = _cfg(task, f"data.seed={i}", "data.max_history=24")
        host = _extra_fields(make_global_batch(cfg, 6, real, first_id=100 * i), i)
        stats = sample_stats(host, HSTUCost.from_model_config(cfg.model), task)
        gathered = shufflers["allgather"].allgather_stats(stats)
        if not np.array_equal(gathered, stats):
            failures.append(f"case {i}: stats gather differs")
        for name, plan in _plans(host, world, i).items():
            ref = exchange_reference(host, plan)
            outs = {}
            for kind, sh in shufflers.items():
                placed = sh.to_device(host)
                sh.allgather_stats(stats)  # sizes and starts the copy of `placed`
                if [b.diff(h) for b, h in zip(jb.to_jagged(placed.batch), host)] != [[]] * world:
                    failures.append(f"case {i} {kind}: placement not lossless")
                out = sh.exchange(placed, plan, None)
                outs[kind] = jb.to_jagged(out.batch)
                for r in range(world):
                    d = outs[kind][r].diff(ref[r])
                    if d:
                        failures.append(f"case {i} plan {name} {kind} rank {r}: {d}")
            for r in range(world):
                if outs["allgather"][r].diff(outs["all2all"][r]):
                    failures.append(f"case {i} plan {name}: allgather != all2all on rank {r}")
            info.append(
                {
                    "case": i,
                    "plan": name,
                    "moved": plan.num_moved(),
                    "capacity": [placed.token_capacity, out.token_capacity],
                }
            )

    # A fixed number of collectives whatever the number of keys.
    rng = np.random.default_rng(0)
    keyed = []
    for r in range(world):
        lens = {
            f"k{j}": np.where(np.arange(6) < 4, rng.integers(0, 5, 6), 0)
            for j in range(num_keys_check)
        }
        keyed.append(
            JaggedBatch(
                6,
                4,
                lens,
                {k: rng.integers(0, 99, int(v.sum())) for k, v in lens.items()},
                {"sample_id": np.where(np.arange(6) < 4, r * 6 + 1, 0)},
            )
        )
    plan = _plans(keyed, world, 0)["random"]
    counts = {}
    for kind, sh in shufflers.items():
        placed = sh.ensure(sh.to_device(keyed))  # single process: no stats needed
        out = sh.exchange(placed, plan, None)
        ref = exchange_reference(keyed, plan)
        if any(a.diff(b) for a, b in zip(jb.to_jagged(out.batch), ref)):
            failures.append(f"{num_keys_check}-key batch: {kind} differs from the reference")
        xspec, tables = plan_exchange(plan, placed.lengths, placed.batch.spec, kind)
        tables = {k: col.put_local(mesh, v) for k, v in tables.items()}
        hlo = col.exchange_fn(mesh, xspec).lower(placed.batch, tables).as_text()
        counts[kind] = {
            "all_gather": hlo.count('"stablehlo.all_gather"'),
            "all_to_all": hlo.count('"stablehlo.all_to_all"'),
        }
    return {"failures": failures, "info": info, "collectives": counts}


def invariance(tasks: list, cases: list) -> dict:
    """Loss and gradients: identity placement vs balanced exchange (both kinds); each
    batch's placed loss-token count (a replicated device scalar) against the host value."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.model import build_model, flax_to_params
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.train_step import init_state, make_loss_fn, make_optimizer
    from hstu.params import init_params
    from hstu.pipeline import STAT_LOSS_TOKENS, sample_stats
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    mesh = col.make_mesh(jax.devices())
    out = []
    for task in tasks:
        cfg = _cfg(task, "model.num_layers=1", "model.rab_time_buckets=8", "data.max_history=40")
        model = build_model(cfg.model, cfg.data.max_seqlen)
        state = init_state(init_params(cfg.model, 0), make_optimizer(cfg.train), mesh)
        grad_fn = jax.jit(jax.value_and_grad(make_loss_fn(model, mesh, train=False), has_aux=True))
        for real in cases:
            host = make_global_batch(cfg, 6, real, first_id=sum(real))
            cost = HSTUCost.from_model_config(cfg.model)
            glt = float(sample_stats(host, cost, task)[:, STAT_LOSS_TOKENS].sum())
            results = {}
            for kind, exchange, shuffler, on_host in (
                ("identity", "allgather", "identity", True),
                ("allgather", "allgather", "balanced", False),
                ("all2all", "all2all", "balanced", False),
                ("host", "allgather", "balanced", True),
            ):
                prep = JaxShuffler(mesh, exchange, host_exchange=on_host).shuffle(
                    host, cost, task, shuffler=shuffler
                )
                # The count rides the batch's copy: a float32 scalar replicated on every device.
                tokens = prep.device_batch.loss_tokens_device
                tokens_ok = (
                    prep.device_batch.loss_tokens == int(glt)
                    and tokens is not None
                    and tokens.dtype == np.float32
                    and float(tokens) == glt
                    and tokens.sharding == NamedSharding(mesh, P())
                    and tokens.sharding.is_fully_replicated
                    and tokens.sharding.device_set == set(jax.devices())
                )
                batch = prep.device_batch.batch
                (loss, aux), grads = grad_fn(state.params, batch, tokens, state.rng)
                (host_loss, _), _ = grad_fn(state.params, batch, glt, state.rng)
                results[kind] = (
                    float(loss),
                    flax_to_params(grads),
                    prep.device_batch.token_capacity,
                    prep.plan.num_moved(),
                    bool(tokens_ok and float(loss) == float(host_loss)),
                )
            base_loss, base_grads, cap, _, base_tokens_ok = results["identity"]
            for kind in ("allgather", "all2all", "host"):
                loss, grads, cap_after, moved, tokens_ok = results[kind]
                worst = max(
                    float(
                        np.linalg.norm(grads[k] - base_grads[k])
                        / max(np.linalg.norm(base_grads[k]), 1e-30)
                    )
                    for k in base_grads
                )
                finite = all(np.isfinite(g).all() for g in grads.values())
                out.append(
                    {
                        "task": task,
                        "real": real,
                        "kind": kind,
                        "moved": moved,
                        "finite": bool(finite and np.isfinite(loss)),
                        "loss_rel": abs(loss - base_loss) / abs(base_loss),
                        "grad_rel": worst,
                        "loss": loss,
                        "capacity": [cap, cap_after],
                        "loss_tokens_ok": [base_tokens_ok, tokens_ok],
                    }
                )
    return {"results": out}


def norm_kernels(real: list) -> dict:
    """The loss and gradients of one global batch on every device (shard_map, its varying-axes
    checks off once a Pallas kernel runs), with the norms as Pallas kernels (interpreted) and
    without, each placed by identity and by the balanced allgather exchange: what a GPU runs by
    default (`model.fused_norm`) at W > 1, against flax's norms; and without them, the forward
    reading the weights' copies (`TrainState.copies`, here in fp32: the same values)."""
    import jax
    import numpy as np

    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.model import build_model, flax_to_params, weight_copies
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.train_step import init_state, make_loss_fn, make_optimizer
    from hstu.params import init_params
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    mesh = col.make_mesh(jax.devices())
    cfg = _cfg("ranking", "model.num_layers=2", "data.max_history=40")
    state = init_state(init_params(cfg.model, 0), make_optimizer(cfg.train), mesh)
    host = make_global_batch(cfg, 6, real, first_id=sum(real))
    cost = HSTUCost.from_model_config(cfg.model)
    results, in_jaxpr = {}, {}
    for kernel in (None, "interpret"):
        model = build_model(cfg.model, cfg.data.max_seqlen, norm_kernel=kernel)
        grad_fn = jax.value_and_grad(make_loss_fn(model, mesh, train=False), has_aux=True)
        for shuffler in ("identity", "balanced"):
            prep = JaxShuffler(mesh, "allgather").shuffle(host, cost, "ranking", shuffler=shuffler)
            batch, tokens = prep.device_batch.batch, prep.device_batch.loss_tokens_device
            args = (state.params, batch, tokens, state.rng)
            in_jaxpr[str(kernel)] = "gated_norm_fwd" in str(jax.make_jaxpr(grad_fn)(*args))
            (loss, _), grads = jax.jit(grad_fn)(*args)
            moved = prep.plan.num_moved()
            results[(kernel, shuffler)] = (float(loss), flax_to_params(grads), moved)
            if kernel is None:  # the weights' copies (`TrainState.copies`) under shard_map
                copies = weight_copies(state.params, jax.numpy.float32)
                (loss, _), grads = jax.jit(grad_fn)(*args, copies)
                results[("copies", shuffler)] = (float(loss), flax_to_params(grads), moved)
    base_loss, base_grads, _ = results[(None, "identity")]
    out = []
    for (kernel, shuffler), (loss, grads, moved) in results.items():
        worst = max(
            float(
                np.linalg.norm(grads[k] - base_grads[k]) / max(np.linalg.norm(base_grads[k]), 1e-30)
            )
            for k in base_grads
        )
        out.append(
            {
                "kernel": kernel,
                "shuffler": shuffler,
                "moved": moved,
                "loss_rel": abs(loss - base_loss) / abs(base_loss),
                "grad_rel": worst,
                "norm_grad": float(np.abs(grads["layers.1.attn_norm.scale"]).max()),
            }
        )
    return {"world": mesh.size, "results": out, "in_jaxpr": in_jaxpr}


def table_rows(cases: list) -> dict:
    """Three balanced steps of the whole train step (AdamW, donation off) with the item
    table's gradient from the global batch's rows (`table_rows`) and from the dense
    parameter, per case `[task, *overrides]`: metrics, whether the rows path can apply (the
    global batch reads fewer rows than the table holds) and the largest parameter gap."""
    import jax
    import numpy as np

    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.model import build_model, flax_to_params
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.train_step import (
        init_state,
        make_optimizer,
        make_train_step,
        read_capacity,
    )
    from hstu.params import init_params
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    mesh = col.make_mesh(jax.devices())
    world = len(jax.devices())
    out = []
    for task, *extra in cases:
        cfg = _cfg(task, "model.num_layers=1", "data.max_history=40", "train.weight_decay=0.1",
                   *extra)  # fmt: skip
        model = build_model(cfg.model, cfg.data.max_seqlen)
        cost = HSTUCost.from_model_config(cfg.model)
        steps = [make_global_batch(cfg, 6, ((6, 2, 0, 5), (3, 6, 6, 1), (4, 4, 2, 6))[i][:world],
                                   first_id=20 * i) for i in range(3)]  # fmt: skip
        runs = {}
        for rows in (False, True):
            opt = make_optimizer(cfg.train)
            state = init_state(init_params(cfg.model, 0), opt, mesh)
            step = make_train_step(model, opt, mesh, donate=False, table_rows=rows)
            metrics, reads = [], []
            for host in steps:
                prep = JaxShuffler(mesh, "allgather").shuffle(host, cost, task)
                batch = prep.device_batch.batch
                reads.append(read_capacity(batch))
                state, m = step(state, batch, prep.device_batch.loss_tokens_device)
                metrics.append({k: float(v) for k, v in m.items()})
            runs[rows] = metrics, reads, flax_to_params(state.params)
        (want, reads, want_p), (got, _, got_p) = runs[False], runs[True]
        gap = max(float(np.abs(got_p[k] - want_p[k]).max()) for k in want_p)
        moved = float(
            np.abs(got_p["embedding.item"] - init_params(cfg.model, 0)["embedding.item"]).max()
        )
        out.append({"case": [task, *extra], "dense": want, "rows": got, "reads": reads,
                    "num_items": cfg.model.num_items, "param_gap": gap,
                    "item_moved": moved})  # fmt: skip
    return {"results": out, "world": world}


def rank_timer() -> dict:
    """`RankTimer` over a 2-device mesh: each rank's shard of one balanced batch timed on
    device 0 (`run_on`), then on its own device; the forward + backward program's compiles
    after each."""
    import jax

    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.model import build_model
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.jax_backend.timing import RankTimer
    from hstu.jax_backend.train_step import init_state, make_optimizer
    from hstu.params import init_params
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    devices = jax.devices()
    mesh = col.make_mesh(devices)
    cfg = _cfg("ranking", "model.num_layers=1", "data.max_history=40")
    model = build_model(cfg.model, cfg.data.max_seqlen)
    state = init_state(init_params(cfg.model, 0), make_optimizer(cfg.train), mesh)
    host = make_global_batch(cfg, 6, (6, 3)[: len(devices)])
    cost = HSTUCost.from_model_config(cfg.model)
    batch = JaxShuffler(mesh, "allgather").shuffle(host, cost, "ranking").device_batch.batch
    timer = RankTimer(model)
    compiles = []
    for run_on in (devices[0], None):
        for d in devices:
            assert timer.time(state.params, batch, d, 10.0, repeats=1, run_on=run_on) > 0
        compiles.append(timer._forward_backward._cache_size())
    return {"world": len(devices), "compiles": compiles}


def train(overrides: list, kill_after_step: int | None = None, wait_for: str | None = None) -> dict:
    """`train(cfg)`; optionally SIGKILL itself after a step, once `wait_for` exists on disk."""
    import signal
    import time

    from hstu.config import load_config
    from hstu.jax_backend.launch import train as jax_train
    from hstu.testing import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, overrides)

    def on_step(step, metrics):
        print(f"STEP {step} {metrics['loss']!r}", flush=True)
        if kill_after_step is not None and step == kill_after_step:
            deadline = time.time() + 60
            while wait_for and not Path(wait_for).is_dir() and time.time() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    rows = jax_train(cfg, on_step=on_step)
    return {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows], "rows": rows}


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("HSTU_TEST_DEVICES", "4")))
    result = globals()[sys.argv[1]](**json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
