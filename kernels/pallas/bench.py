"""Microbenchmark: Pallas HSTU attention vs the jnp reference (GPU).

    python -m hstu_kernels.pallas.bench [--seqlens 512 1024 2048 4096] [--tokens 16384]

Every sample has length ``seqlen`` (batch = tokens // seqlen), causal mask, no bias.
Times are medians over ``--repeats`` runs after ``--warmup`` runs (``jax.block_until_ready``).
TFLOP/s use the exact unmasked pair count: forward ``4 * pairs * H * D`` (two matmuls),
forward+backward ``12 * pairs * H * D`` (forward plus four backward matmuls; the score
recomputation of the backward is not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from .hstu_attention import BlockSizes, hstu_attention
from .reference import hstu_attention_reference


def _median_time(fn, args, warmup: int, repeats: int, calls: int = 1) -> float:
    """Median seconds per call: each repeat dispatches ``calls`` calls back to back and waits
    once (``calls`` > 1: the dispatch latency is paid once per repeat, not per call)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _build(impl, seq_offsets, static, tables):
    def fwd(q, k, v, *tabs):
        return impl(q, k, v, seq_offsets, **static, **dict(zip(tables, tabs)))

    def fwd_bwd(q, k, v, *rest):
        *tabs, do = rest
        out, vjp = jax.vjp(fwd, q, k, v, *tabs)
        return (out, *vjp(do))

    return jax.jit(fwd), jax.jit(fwd_bwd)


def _try_time(fn, args, warmup, repeats):
    try:
        return _median_time(fn, args, warmup, repeats)
    except Exception as exc:  # e.g. the dense reference running out of memory
        print(f"    ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--block-q", type=int, default=64)
    ap.add_argument("--block-k", type=int, default=32)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-reference", action="store_true", help="skip the jnp reference")
    ap.add_argument("--rab", action="store_true", help="add rab_pos [H, seqlen] and rab_time")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke)")
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    interpret = args.interpret or backend == "cpu"
    if backend != "gpu":
        print(f"warning: default backend is {backend!r}; timings are not GPU timings")
    blocks = BlockSizes(args.block_q, args.block_k, args.num_warps, args.num_stages)
    dtype = jnp.dtype(args.dtype)
    h, d = args.heads, args.dim
    print(
        f"device={jax.devices()[0].device_kind} jax={jax.__version__} dtype={args.dtype} "
        f"H={h} D={d} rab={args.rab} {blocks} interpret={interpret}"
    )
    header = (
        f"{'seqlen':>6} {'B':>4} | {'fwd ms':>8} {'TF/s':>6} {'ref ms':>8} {'TF/s':>6} | "
        f"{'f+b ms':>8} {'TF/s':>6} {'ref ms':>8} {'TF/s':>6}"
    )
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for n in args.seqlens:
        bsz = max(1, args.tokens // n)
        t = bsz * n
        offs = jnp.asarray(np.arange(bsz + 1) * n, jnp.int32)
        q, k, v, do = (
            jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32).astype(dtype) for _ in range(4)
        )
        static = dict(max_seqlen=n, alpha=1.0 / np.sqrt(d), normalizer=float(n))
        tabs = {}
        if args.rab:
            ts = np.cumsum(rng.integers(0, 3600, t)).astype(np.int32)
            static["timestamps"] = jnp.asarray(ts)
            tabs["rab_pos"] = jnp.asarray(rng.standard_normal((h, n)) * 0.1, jnp.float32)
            tabs["rab_time"] = jnp.asarray(rng.standard_normal((h, 32)) * 0.1, jnp.float32)
        targs = tuple(tabs.values())
        pairs = bsz * n * (n + 1) // 2
        flops_f, flops_fb = 4 * pairs * h * d, 12 * pairs * h * d

        ker_f, ker_fb = _build(
            lambda *a, **kw: hstu_attention(*a, **kw, block_sizes=blocks, interpret=interpret),
            offs,
            static,
            tuple(tabs),
        )
        fa, fba = (q, k, v, *targs), (q, k, v, *targs, do)
        row = [_try_time(ker_f, fa, args.warmup, args.repeats), float("nan")]
        row += [_try_time(ker_fb, fba, args.warmup, args.repeats), float("nan")]
        if not args.no_reference:
            ref_f, ref_fb = _build(hstu_attention_reference, offs, static, tuple(tabs))
            row[1] = _try_time(ref_f, fa, args.warmup, args.repeats)
            row[3] = _try_time(ref_fb, fba, args.warmup, args.repeats)

        def tf(flops, sec):
            return flops / sec / 1e12

        print(
            f"{n:>6} {bsz:>4} | {row[0] * 1e3:8.3f} {tf(flops_f, row[0]):6.1f} "
            f"{row[1] * 1e3:8.3f} {tf(flops_f, row[1]):6.1f} | "
            f"{row[2] * 1e3:8.3f} {tf(flops_fb, row[2]):6.1f} "
            f"{row[3] * 1e3:8.3f} {tf(flops_fb, row[3]):6.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
