"""Jitted data-parallel train step, the pipeline Backend, and `train(cfg)`.

The step is one jitted program: per rank (shard_map over "data") the model's loss divided by
the global loss-token count; the sum over ranks is the reported loss (a psum), and its gradient
with respect to the replicated params is the psum of the per-rank gradients (the transpose of
a replicated shard_map input), then Optax AdamW. Where a sample trains never changes the loss
or the gradient, so identity and balanced shuffling agree to float rounding.

Order of parallelism, in one place: (1) the core pipeline's balanced shuffle of the batch over
the data axis, (2) the data-parallel step over the same axis, params replicated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hstu.config import TrainConfig
from hstu.errors import HSTUError
from hstu.jax_backend import collectives as col
from hstu.jax_backend.batch import DeviceBatch, local_view
from hstu.jax_backend.model import HSTUModel, params_to_flax
from hstu.jax_backend.shuffler import JaxShuffler, Placed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 [2]: base key; dropout uses fold_in(rng, step, rank)

    def as_dict(self) -> dict:
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "step": self.step,
            "rng": self.rng,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        return cls(d["params"], d["opt_state"], d["step"], d["rng"])


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW on every parameter, decoupled weight decay (== torch.optim.AdamW)."""
    return optax.adamw(tc.lr, b1=tc.beta1, b2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay)


def init_state(
    params: dict[str, np.ndarray],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    seed: int = 0,
) -> TrainState:
    """Replicated state from core-layout params (`hstu.params.init_params`)."""
    tree = params_to_flax(params)
    state = TrainState(
        tree, optimizer.init(tree), jnp.zeros((), jnp.int32), jax.random.PRNGKey(seed)
    )
    return jax.device_put(state, NamedSharding(mesh, P()))


def make_loss_fn(model: HSTUModel, mesh: Mesh, train: bool = True) -> Callable:
    """`(params, batch, global_loss_tokens, rng) -> (loss, aux)`: global, over all ranks.

    Differentiable: its gradient is the all-reduced gradient. `batch` is a global DeviceBatch.
    """

    def per_rank(params, batch, global_loss_tokens, rng):
        rng = jax.random.fold_in(rng, jax.lax.axis_index(col.DATA_AXIS))
        loss, aux = model.apply(
            {"params": params},
            local_view(batch),
            global_loss_tokens,
            deterministic=not train,
            rngs={"dropout": rng},
        )
        return jax.lax.psum((loss, aux), col.DATA_AXIS)

    # pallas_call outputs carry no varying-axes type, so the kernel runs unchecked; the
    # gradient of the replicated params is the psum of per-rank gradients either way.
    return col.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), P(col.DATA_AXIS), P(), P()),
        out_specs=(P(), P()),
        check=model.attn.impl == "reference",
    )


def make_train_step(
    model: HSTUModel, optimizer: optax.GradientTransformation, mesh: Mesh, donate: bool = True
) -> Callable:
    """Jitted `(state, batch, global_loss_tokens) -> (state, metrics)`; donates the state."""
    loss_fn = make_loss_fn(model, mesh)

    def step(state: TrainState, batch: DeviceBatch, global_loss_tokens):
        rng = jax.random.fold_in(state.rng, state.step)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch, global_loss_tokens, rng
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
        return TrainState(params, opt_state, state.step + 1, state.rng), metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


class JaxBackend:
    """`hstu.pipeline.Backend` over a mesh: the shuffler's data half plus the fused step."""

    def __init__(self, shuffler: JaxShuffler, step_fn: Callable, state: TrainState):
        self.shuffler, self.step_fn, self.state = shuffler, step_fn, state
        self.world_size, self.local_ranks = shuffler.world_size, shuffler.local_ranks

    def to_device(self, batches):
        return self.shuffler.to_device(batches)

    def allgather_stats(self, local_stats: np.ndarray) -> np.ndarray:
        return self.shuffler.allgather_stats(local_stats)

    def exchange(self, placed: Placed, plan, stats: np.ndarray) -> Placed:
        return self.shuffler.exchange(placed, plan, stats)

    def forward_backward(self, placed: Placed, global_loss_tokens: int):
        """Dispatches forward, backward, gradient psum *and* the AdamW update (one program,
        async): the pipeline's exchange of the next batch queues behind it."""
        placed = self.shuffler.ensure(placed)
        self.shuffler.compiled.add(("train_step", placed.batch.spec))
        self.state, metrics = self.step_fn(self.state, placed.batch, np.float32(global_loss_tokens))
        return metrics, placed

    def optimizer_step(self, handle) -> dict[str, float]:
        metrics, placed = handle
        # Replicated scalars; read this process's copy (multi-process arrays are not fully
        # addressable, so no device_get of the global value).
        out = {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}
        return out | placed.metrics() | {"num_compiles": self.shuffler.num_compiles}


# ------------------------------------------------------------------------------ devices
_REEXEC_ENV = "HSTU_JAX_REEXEC"  # set in the fresh process: never re-execute twice


def init_distributed() -> None:
    """`jax.distributed.initialize` when JAX_COORDINATOR_ADDRESS is set (multi-process)."""
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not addr or jax.distributed.is_initialized():
        return
    num = os.environ.get("JAX_NUM_PROCESSES")
    pid = os.environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(addr, int(num) if num else None, int(pid) if pid else None)


def select_devices(world_size: int, device: str = "auto") -> list[jax.Device] | None:
    """The `world_size` devices to train on, or None when JAX already runs with too few
    host devices (the caller re-executes in a fresh process)."""
    nproc = int(os.environ.get("JAX_NUM_PROCESSES", "1") or 1)
    if device in ("auto", "cpu"):
        try:  # must precede backend initialisation; harmless when a GPU is used
            jax.config.update("jax_num_cpu_devices", max(world_size // nproc, 1))
            if nproc > 1:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (RuntimeError, AttributeError):
            pass  # already initialised: checked below
    init_distributed()
    platform = {"auto": None, "cpu": "cpu", "cuda": "gpu", "gpu": "gpu"}[device]
    try:
        devices = jax.devices(platform) if platform else jax.devices()
    except RuntimeError as exc:
        raise HSTUError(f"dist.device={device!r}: no such JAX devices ({exc})") from exc
    if len(devices) < world_size:
        if (
            devices[0].platform == "cpu"
            and jax.process_count() == 1
            and not os.environ.get(_REEXEC_ENV)
        ):
            return None
        raise HSTUError(
            f"dist.world_size={world_size} but only {len(devices)} "
            f"{devices[0].platform} devices are visible to JAX"
        )
    if jax.process_count() > 1 and len(devices) != world_size:
        raise HSTUError(
            f"multi-process runs use every device: dist.world_size must be "
            f"{len(devices)}, got {world_size}"
        )
    return sorted(devices, key=lambda d: (d.process_index, d.id))[:world_size]


def train_in_subprocess(cfg) -> list[dict]:
    """Run `train(cfg)` in a fresh interpreter (this one initialised JAX with too few CPU
    devices, and the count cannot change after initialisation)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, rows_path = Path(tmp) / "config.yaml", Path(tmp) / "rows.json"
        cfg.save(cfg_path)
        cmd = [sys.executable, "-m", "hstu.jax_backend.train_step", str(cfg_path), str(rows_path)]
        proc = subprocess.run(cmd, check=False, env=dict(os.environ, **{_REEXEC_ENV: "1"}))
        if proc.returncode != 0:
            raise HSTUError(f"JAX training subprocess failed (exit {proc.returncode})")
        return json.loads(rows_path.read_text())


def train(cfg, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train `cfg` (see hstu.config); per-step metrics on process 0, [] elsewhere.

    Sets up the devices first (CPU: `dist.world_size` host devices, which must happen before
    JAX initialises; if it already has, with too few, the run moves to a fresh process).
    """
    devices = select_devices(cfg.dist.world_size, cfg.dist.device)
    if devices is None:
        if on_step is not None:
            raise HSTUError(
                f"JAX is already initialised with fewer than "
                f"dist.world_size={cfg.dist.world_size} CPU devices; start a fresh "
                "process (or set XLA_FLAGS=--xla_force_host_platform_device_count)"
            )
        return train_in_subprocess(cfg)
    return run_training(cfg, devices, on_step)


def run_training(cfg, devices: list[jax.Device], on_step=None) -> list[dict]:
    """The core pipeline over `devices`, with checkpoints, resume and the metrics logger."""
    from hstu.data.synthetic import dataset_from_config
    from hstu.jax_backend.checkpoint import Checkpointer, abstract_like
    from hstu.jax_backend.model import build_model
    from hstu.metrics import MetricsLogger, peak_tflops
    from hstu.params import init_params
    from hstu.pipeline import run
    from hstu.workload import HSTUCost

    tc, out_dir = cfg.train, Path(cfg.output_dir)
    mesh = col.make_mesh(devices)
    main = jax.process_index() == 0
    model = build_model(cfg.model, cfg.data.max_seqlen, interpret=devices[0].platform == "cpu")
    optimizer = make_optimizer(tc)
    state = init_state(init_params(cfg.model, tc.seed), optimizer, mesh, tc.seed)
    start = first_batch = 0
    ckpt = (
        Checkpointer(out_dir / "checkpoints", tc.keep_checkpoints)
        if tc.checkpoint_every or tc.resume
        else None
    )
    if tc.resume and ckpt.latest_step() is not None:
        restored, data_state, start = ckpt.restore(abstract_like(state.as_dict()))
        state, first_batch = TrainState.from_dict(restored), int(data_state["next_batch"])
        if main:
            print(f"resumed from {ckpt.directory}/step-{start}", flush=True)
    if main:
        cfg.save(out_dir / "config.yaml")
    if start >= tc.steps:
        return []
    dataset = dataset_from_config(cfg, cfg.dist.world_size, 0)
    backend = JaxBackend(
        JaxShuffler(mesh, cfg.balance.exchange), make_train_step(model, optimizer, mesh), state
    )
    peak = peak_tflops(devices[0].device_kind, tc.peak_tflops)
    logger = MetricsLogger(out_dir, tc.steps, tc.log_every, peak) if main else None

    def batches():
        t = first_batch
        while True:
            yield [dataset.batch(t, r) for r in backend.local_ranks]
            t += 1

    def hook(step: int, metrics: dict) -> None:
        if logger:
            logger.log(step, metrics)
        if tc.checkpoint_every and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps):
            ckpt.save(
                step + 1, backend.state.as_dict(), {"next_batch": first_batch + step - start + 1}
            )
        if on_step:
            on_step(step, metrics)

    try:
        rows = run(
            backend,
            batches(),
            tc.steps - start,
            HSTUCost.from_model_config(cfg.model),
            cfg.model.task,
            cfg.balance.shuffler,
            cfg.balance.method,
            cfg.balance.overlap,
            on_step=hook,
            start_step=start,
            prefetch=cfg.data.prefetch,
        )
    finally:
        if ckpt:
            ckpt.close()
        if logger:
            logger.close()
    return rows if main else []


if __name__ == "__main__":  # re-exec entry point of train_in_subprocess
    from hstu.config import load_config

    rows = train(load_config(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(rows))
