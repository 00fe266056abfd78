"""Workers and helpers of the parity suite: the same inputs through the torch and the jax paths.

* demo training runs go through `hstu train` in a fresh process per run (`DemoRuns`);
* torch rank workers run under `torch_workers.run_on_ranks` (gloo processes, tests/multirank);
* jax workers run in a fresh interpreter with N host devices (the count must be set before JAX
  initialises), and the kernel worker in one with TRITON_INTERPRET=1 set before triton loads:

      python tests/parity/parity_workers.py <worker> <json kwargs> <result.pkl>

Inputs are built from the config and seeds alone (`exchange_cases`, `kernel_inputs`), so both
sides see identical data; results come back pickled (numpy arrays, core JaggedBatches).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

from hstu.parity import FP32_ENV, run_backend
from hstu.testing import DEMO_CONFIG

REPO = Path(__file__).resolve().parents[2]
JAX_CACHE_DIR = Path(tempfile.gettempdir()) / f"hstu-jax-test-cache-{os.getuid()}"
WORLD = 4


def jax_test_env(devices: int | None = None) -> dict[str, str]:
    """Environment of a JAX subprocess: CPU, `devices` host devices, shared compile cache."""
    env = {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(JAX_CACHE_DIR),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    }
    if devices is not None:
        env["HSTU_TEST_DEVICES"] = str(devices)
    return env


def run_subprocess_worker(name: str, env: dict[str, str], timeout: float = 300, **kwargs):
    """`name(**kwargs)` in a fresh interpreter with `env`; its pickled return value."""
    with tempfile.TemporaryDirectory(prefix="hstu-parity-") as tmp:
        out = Path(tmp) / "result.pkl"
        cmd = [sys.executable, str(Path(__file__).resolve()), name, json.dumps(kwargs), str(out)]
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0 or not out.is_file():
            raise AssertionError(
                f"worker {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                f"{proc.stderr[-6000:]}"
            )
        return pickle.loads(out.read_bytes())


# ------------------------------------------------------------------------------ training
DEMO_STEPS = 30
GOLDEN = Path(__file__).resolve().parent / "golden_demo_losses.json"


def demo_overrides(
    shuffler: str = "balanced", exchange: str = "allgather", steps: int = DEMO_STEPS
) -> list[str]:
    return [
        f"train.steps={steps}",
        f"balance.shuffler={shuffler}",
        f"balance.exchange={exchange}",
        "train.log_every=100",
    ]


class DemoRuns:
    """`rows(backend, shuffler, exchange)`: metric rows of a 30-step demo run (4 ranks, fp32,
    no dropout), trained through `hstu train` in a fresh process on first use."""

    def __init__(self, root: Path):
        self.root, self._rows = root, {}

    def rows(self, backend: str, shuffler: str = "balanced", exchange: str = "allgather"):
        key = (backend, shuffler, exchange)
        if key not in self._rows:
            env = {**FP32_ENV, **jax_test_env()}
            overrides = demo_overrides(shuffler, exchange)
            out = self.root / "-".join(key)
            self._rows[key] = run_backend(backend, DEMO_CONFIG, overrides, out, env)
        return self._rows[key]

    def losses(self, *key: str) -> list[float]:
        return [r["loss"] for r in self.rows(*key)]


# ------------------------------------------------------------------------------ exchange
def exchange_cases() -> list[tuple[str, object, list]]:
    """(task, config, per-rank batches): demo batches, padding, a rank with no real sample,
    an all-padding global batch, the retrieval keys."""
    from hstu.config import load_config
    from hstu.data import dataset_from_config
    from hstu.testing import DEMO_CONFIG, make_global_batch

    cases = []
    demo = load_config(DEMO_CONFIG, [f"dist.world_size={WORLD}"])
    data = dataset_from_config(demo, WORLD, 0)
    for t in (0, 1):
        cases.append(("ranking", demo, data.global_batch(t)))
    retrieval = load_config(DEMO_CONFIG, ["model.task=retrieval", "data.max_history=24"])
    cases.append(("retrieval", retrieval, make_global_batch(retrieval, 6, (6, 4, 0, 2))))
    cases.append(("ranking", demo, make_global_batch(demo, 6, (0, 0, 0, 0))))
    cases.append(("retrieval", retrieval, make_global_batch(retrieval, 6, (1, 0, 0, 0), 50)))
    return cases


def torch_exchange(rank: int, world: int, device: str) -> list[dict]:
    """This rank's partition, workloads and exchanged batch per case, both exchanges, through
    the torch Backend and the core Balancer (as in training)."""
    from hstu.pipeline import Balancer, sample_stats
    from hstu.torch_backend.batch import to_jagged, to_torch
    from hstu.torch_backend.shuffler import TorchShuffler, local_workloads
    from hstu.workload import HSTUCost

    out = []
    for task, cfg, batches in exchange_cases():
        cost = HSTUCost.from_model_config(cfg.model)
        local = [batches[rank]]
        case = {"workloads": local_workloads(to_torch(batches[rank]).to(device), cost)}
        for exchange in ("allgather", "all2all"):
            shuffler = TorchShuffler(rank, world, device, batches[0].batch_size, exchange)
            balancer = Balancer(shuffler, "balanced", overlap=False)
            placed = shuffler.to_device(local)
            prepared = balancer.phase2(*balancer.phase1(placed, sample_stats(local, cost, task)))
            case[exchange] = {
                "stats": prepared.stats,
                "indices": prepared.plan.indices,
                "num_real": prepared.plan.num_real,
                "batch": to_jagged(prepared.device_batch),
                "workloads_after": local_workloads(prepared.device_batch, cost),
            }
        out.append(case)
    return out


def jax_exchange() -> list[dict]:
    """Every rank's partition, workloads and exchanged batch per case, both exchanges, through
    the JaxShuffler and the core Balancer, on the host devices of this process."""
    import jax

    from hstu.jax_backend import batch as jb
    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.shuffler import JaxShuffler, local_workloads
    from hstu.workload import HSTUCost

    mesh = col.make_mesh(jax.devices())
    assert mesh.size == WORLD, mesh
    out = []
    for task, cfg, batches in exchange_cases():
        cost = HSTUCost.from_model_config(cfg.model)
        shufflers = {
            kind: JaxShuffler(mesh, kind, host_exchange=False) for kind in ("allgather", "all2all")
        }
        placed = shufflers["allgather"].ensure(shufflers["allgather"].to_device(batches))
        case = {"workloads": local_workloads(placed.batch, cost)}
        for exchange, shuffler in shufflers.items():
            prepared = shuffler.shuffle(batches, cost, task, "balanced")
            case[exchange] = {
                "stats": prepared.stats,
                "indices": prepared.plan.indices,
                "num_real": prepared.plan.num_real,
                "batches": jb.to_jagged(prepared.device_batch.batch),
                "workloads_after": local_workloads(prepared.device_batch.batch, cost),
            }
        out.append(case)
    return out


# ------------------------------------------------------------------------------ kernels
# name -> (contextual, candidates, rab_pos, rab_time): each mask feature alone, then together
KERNEL_CASES = {
    "causal": (False, False, False, False),
    "contextual": (True, False, False, False),
    "candidates": (False, True, False, False),
    "ctx_cand": (True, True, False, False),
    "rab_pos": (False, False, True, False),
    "rab_time": (False, False, False, True),
    "all": (True, True, True, True),
}
KERNEL_SHAPES = {
    # a zero-length and a length-1 sample, capacity padding past the last offset
    "interpret": dict(
        lengths=[13, 0, 1, 40, 7], ctx=[3, 0, 1, 5, 0], cand=[2, 0, 0, 6, 3], H=2, D=16, Dv=24
    ),
    "gpu": dict(
        lengths=[300, 0, 1, 700, 77],
        ctx=[10, 0, 1, 64, 0],
        cand=[20, 0, 0, 100, 7],
        H=4,
        D=64,
        Dv=64,
    ),
}
KERNEL_OUTPUTS = ("out", "dq", "dk", "dv", "drab_pos", "drab_time")


def kernel_inputs(case: str, mode: str) -> dict:
    """Seeded numpy inputs of one case (fp32 tensors, int64 ids/timestamps)."""
    shape = KERNEL_SHAPES[mode]
    has_ctx, has_cand, has_pos, has_time = KERNEL_CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"{mode}/{case}".encode()))
    lengths = np.asarray(shape["lengths"], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    t_cap = int(offsets[-1]) + 3
    h, d, dv = shape["H"], shape["D"], shape["Dv"]
    max_seqlen = int(lengths.max()) + 2  # a config bound, not the batch's maximum

    def rand(*s, scale=1.0):
        return (rng.standard_normal(s) * scale).astype(np.float32)

    inp = {
        "q": rand(t_cap, h, d),
        "k": rand(t_cap, h, d),
        "v": rand(t_cap, h, dv),
        "cot": rand(t_cap, h, dv),
        "seq_offsets": offsets,
        "max_seqlen": max_seqlen,
        "alpha": 1.0 / np.sqrt(d),
        "normalizer": float(max_seqlen),
        "num_contextual": np.asarray(shape["ctx"], np.int64) if has_ctx else None,
        "num_candidates": np.asarray(shape["cand"], np.int64) if has_cand else None,
        "rab_pos": rand(h, 12, scale=0.5) if has_pos else None,
        "rab_time": rand(h, 8, scale=0.5) if has_time else None,
        # gaps up to 300 s: spans all 8 log2 buckets; int32-safe for the JAX side
        "timestamps": np.cumsum(rng.integers(0, 300, t_cap)).astype(np.int64) if has_time else None,
    }
    return inp


def _torch_attention(fn, inp, device, **extra) -> dict[str, np.ndarray]:
    import torch

    def t(x, dtype=None):
        return None if x is None else torch.as_tensor(x, dtype=dtype, device=device)

    names = ["q", "k", "v", "rab_pos", "rab_time"]
    leaves = {n: t(inp[n]).requires_grad_() for n in names if inp[n] is not None}
    out = fn(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        t(inp["seq_offsets"]),
        max_seqlen=inp["max_seqlen"],
        alpha=inp["alpha"],
        normalizer=inp["normalizer"],
        num_contextual=t(inp["num_contextual"]),
        num_candidates=t(inp["num_candidates"]),
        timestamps=t(inp["timestamps"]),
        rab_pos=leaves.get("rab_pos"),
        rab_time=leaves.get("rab_time"),
        **extra,
    )
    grads = torch.autograd.grad(out, list(leaves.values()), t(inp["cot"]))
    res = {"out": out.detach().cpu().numpy()}
    res |= {f"d{n}": g.detach().cpu().numpy() for n, g in zip(leaves, grads, strict=True)}
    return res


def _jax_attention(fn, inp, **extra) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    def j(x):
        if x is None:
            return None
        return jnp.asarray(x, jnp.int32 if np.issubdtype(x.dtype, np.integer) else jnp.float32)

    names = [n for n in ("q", "k", "v", "rab_pos", "rab_time") if inp[n] is not None]

    def f(*xs):
        a = dict(zip(names, xs, strict=True))
        return fn(
            a["q"],
            a["k"],
            a["v"],
            j(inp["seq_offsets"]),
            max_seqlen=inp["max_seqlen"],
            alpha=inp["alpha"],
            normalizer=inp["normalizer"],
            num_contextual=j(inp["num_contextual"]),
            num_candidates=j(inp["num_candidates"]),
            timestamps=j(inp["timestamps"]),
            rab_pos=a.get("rab_pos"),
            rab_time=a.get("rab_time"),
            **extra,
        )

    out, vjp = jax.vjp(f, *(j(inp[n]) for n in names))
    grads = vjp(j(inp["cot"]))
    res = {"out": np.asarray(out)}
    res |= {f"d{n}": np.asarray(g) for n, g in zip(names, grads, strict=True)}
    return res


def kernels(mode: str = "interpret") -> dict:
    """Forward + gradients of the four implementations on every case's inputs."""
    if mode == "interpret":
        assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 first"
    import hstu_kernels.pallas as pallas
    import hstu_kernels.triton as triton_kernels

    device = "cpu" if mode == "interpret" else "cuda"
    interpret = mode == "interpret"
    pallas_blocks = pallas.BlockSizes(block_q=16, block_k=16) if interpret else None
    results = {}
    for case in KERNEL_CASES:
        inp = kernel_inputs(case, mode)
        results[case] = {
            "triton": _torch_attention(triton_kernels.hstu_attention, inp, device),
            "triton_reference": _torch_attention(
                triton_kernels.hstu_attention_reference, inp, device
            ),
            "pallas": _jax_attention(
                pallas.hstu_attention, inp, interpret=interpret, block_sizes=pallas_blocks
            ),
            "pallas_reference": _jax_attention(pallas.hstu_attention_reference, inp),
            "total": int(inp["seq_offsets"][-1]),
        }
    return results


# ------------------------------------------------------------------------------ sharded tables
SHARDED_STEPS = 30
SHARDINGS = ("table_wise", "row_wise", "data_parallel", "auto")


def sharded_config(sharding: str, out_dir: str, backend: str):
    """A small ranking model, 2 ranks, fp32, tables of uneven row counts, `sharding`."""
    from hstu.config import load_config

    return load_config(
        DEMO_CONFIG,
        [
            f"train.steps={SHARDED_STEPS}",
            "train.log_every=1000",
            "train.tensorboard=false",
            "dist.world_size=2",
            "data.batch_size=4",
            "model.num_layers=1",
            "model.embedding_dim=16",
            "model.num_items=301",
            "model.num_contextual_ids=51",
            f"embedding.sharding={sharding}",
            "embedding.lr=0.05",
            f"output_dir={Path(out_dir) / backend / sharding}",
        ],
    )


def torch_sharded_curves(rank: int, world: int, device: str, out_dir: str) -> dict:
    """Rank 0: `{sharding: losses}`, every sharding trained in this one process group."""
    from hstu.torch_backend.train_step import run_rank

    curves = {}
    for sharding in SHARDINGS:
        rows = run_rank(sharded_config(sharding, out_dir, "torch"), rank, world, device)
        curves[sharding] = [r["loss"] for r in rows]
    return curves


def jax_sharded_curves(out_dir: str) -> dict:
    """`{sharding: losses}` on 2 host devices, every sharding in this one process."""
    from hstu.jax_backend.launch import train

    return {s: [r["loss"] for r in train(sharded_config(s, out_dir, "jax"))] for s in SHARDINGS}


if __name__ == "__main__":
    if os.environ.get("HSTU_TEST_DEVICES"):
        import jax

        jax.config.update("jax_num_cpu_devices", int(os.environ["HSTU_TEST_DEVICES"]))
    result = globals()[sys.argv[1]](**json.loads(sys.argv[2]))
    Path(sys.argv[3]).write_bytes(pickle.dumps(result))
