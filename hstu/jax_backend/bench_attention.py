"""The JAX half of `hstu bench attention`: our Pallas kernel in one lowering of its kernels
(`pallas`: Triton's; `mosaic`: Mosaic GPU's forward, dq and dk/dv), checked against the jnp
fp32 reference, timed on the device from a profiler trace (`device_time.device_ms`), as the
torch half times CUDA-graph replays. On a CPU the kernel runs in the Pallas interpreter and is
timed on the host's clock (`device_time.time_ms`; timings then meaningless)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hstu.bench.attention import Case
from hstu.jax_backend.device_time import time_ms

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
TIME_BUCKETS = 32
TABLES = ("rab_pos", "rab_time")
DEVICE_CALLS = 10  # calls per traced round (device time: the round's length only averages)


KERNEL_NAMES = {"triton": "pallas", "mosaic": "mosaic"}  # lowering -> kernel in tables, files


class Runner:
    def __init__(self, sdpa: bool = True, lowering: str = "triton"):  # no softmax yardstick here
        from hstu_kernels.pallas import hstu_attention
        from hstu_kernels.pallas.reference import hstu_attention_reference

        self.interpret = jax.default_backend() == "cpu"
        self.fn, self.reference = hstu_attention, hstu_attention_reference
        self.device = jax.devices()[0].device_kind
        self.lowering, self.kernel = lowering, KERNEL_NAMES[lowering]

    def problem(self, dims, dtype: str, rab: bool) -> str | None:
        """Why this lowering cannot run the grid's head dims here (None: it can)."""
        if self.lowering != "mosaic":
            return None
        from hstu_kernels.pallas import mosaic_problem

        for d in dims:
            why = mosaic_problem(DTYPES[dtype], d, d, rab, None, self.interpret)
            if why is not None:
                return f"head dim {d}: {why}"
        return None

    def inputs(self, case: Case, seed: int = 0):
        """(q, k, v), grad_out, the batch's arrays (`offsets`, with `--rab` `timestamps`), static
        keyword arguments, bias tables. The arrays are arguments of the timed programs, as in a
        training step: closed over, XLA would fold the kernels' schedule into the program."""
        rng = np.random.default_rng(seed)
        t, h, d = case.tokens, case.heads, case.dim
        dtype = DTYPES[case.dtype]
        q, k, v, do = (
            jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32).astype(dtype) for _ in range(4)
        )
        arrays = {"offsets": jnp.asarray(np.concatenate([[0], np.cumsum(case.lengths)]), jnp.int32)}
        static = dict(max_seqlen=case.seqlen, alpha=1.0 / np.sqrt(d), normalizer=float(case.seqlen))
        tables = {}
        if case.rab:
            tables["rab_pos"] = jnp.asarray(
                rng.standard_normal((h, case.seqlen)) * 0.1, jnp.float32
            )
            tables["rab_time"] = jnp.asarray(
                rng.standard_normal((h, TIME_BUCKETS)) * 0.1, jnp.float32
            )
            arrays["timestamps"] = jnp.asarray(np.cumsum(rng.integers(0, 3600, t)), jnp.int32)
        return (q, k, v), do, arrays, static, tables

    def _fns(self, impl, static, names):
        """`fwd(q, k, v, arrays, *tables)`, `fwd_bwd(q, k, v, arrays, *tables, do)`, jitted."""

        def fwd(q, k, v, arrays, *tabs):
            offsets, extra = arrays["offsets"], {n: a for n, a in arrays.items() if n != "offsets"}
            return impl(q, k, v, offsets, **static, **extra, **dict(zip(names, tabs)))

        def fwd_bwd(q, k, v, arrays, *rest):
            *tabs, do = rest
            out, vjp = jax.vjp(lambda q, k, v, *t: fwd(q, k, v, arrays, *t), q, k, v, *tabs)
            return (out, *vjp(do.astype(out.dtype)))

        return jax.jit(fwd), jax.jit(fwd_bwd)

    def _kernel(self, *args, **kwargs):
        return self.fn(*args, **kwargs, interpret=self.interpret, lowering=self.lowering)

    def check(self, case: Case) -> dict[str, float]:
        """max |kernel - reference| / max |reference| of the output and every gradient."""
        qkv, do, arrays, static, tables = self.inputs(case, seed=1)
        names = tuple(tables)
        _, kernel_fb = self._fns(self._kernel, static, names)
        _, ref_fb = self._fns(self.reference, static, names)
        got = kernel_fb(*qkv, arrays, *tables.values(), do)
        want = ref_fb(*(x.astype(jnp.float32) for x in qkv), arrays, *tables.values(), do)
        errors = {}
        labels = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in names]
        for label, a, b in zip(labels, got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            scale = float(np.abs(b).max())
            diff = float(np.abs(a - b).max())
            errors[label] = diff / scale if scale > 0 else diff
        return errors

    def time(self, case: Case, warmup: int, repeats: int) -> tuple[float, float, str]:
        qkv, do, arrays, static, tables = self.inputs(case)
        fwd, fwd_bwd = self._fns(self._kernel, static, tuple(tables))
        args = (*qkv, arrays, *tables.values())
        runs = {"fwd": (fwd, args), "fwd_bwd": (fwd_bwd, (*args, do))}
        try:
            ms = time_ms(runs, DEVICE_CALLS, repeats, warmup, trace=not self.interpret)
        except Exception as exc:  # out of device memory: report the point, go on
            if "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            return float("nan"), float("nan"), "out of memory"
        return ms["fwd"], ms["fwd_bwd"], ""

    def extra_kernels(self, case: Case) -> list[str]:
        return []

    def time_extra(self, name, case, warmup, repeats):
        raise ValueError(f"no extra kernel {name!r} on the jax side")
