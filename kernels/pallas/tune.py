"""Block-size sweep of the Pallas HSTU attention kernels, per head dim (GPU).

    python -m hstu_kernels.pallas.tune [--dims 128,256] [--seqlen 4096 --batch 8]

The Pallas twin of ``hstu_kernels.triton.tune``, on the same two batches: equal lengths
(``batch`` x ``seqlen``, causal) and one shaped like ``configs/bench_upstream.yaml``
(``hstu_kernels.tune_cases``). Forward candidates are timed forward only; a dk/dv or dq
candidate is timed as forward + backward with the other kernels at their defaults (a
custom_vjp's backward cannot be jitted alone through the public entry), so backward rows
compare with each other, not with forward rows. Times: medians over ``--repeats`` of
``--calls`` calls dispatched back to back before one ``block_until_ready`` (wall time per
call after a compiling warm-up; one wait per repeat, not per call). Every candidate's
output and gradients are first compared with the defaults' (a tile that computes something
else is reported, never timed). The defaults in ``_common._TUNED`` come from this table.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from ..tune_cases import MAX_SEQLEN, bench_upstream_batch, mask_pairs, sweep_table
from .bench import _median_time
from .hstu_attention import KERNELS, BlockSizes, default_block_sizes, hstu_attention

FWD_CANDIDATES = [
    BlockSizes(64, 32, 4, 3), BlockSizes(64, 32, 4, 2), BlockSizes(64, 64, 4, 2),
    BlockSizes(64, 64, 8, 2), BlockSizes(64, 64, 4, 3), BlockSizes(128, 64, 8, 2),
    BlockSizes(128, 32, 8, 2), BlockSizes(32, 32, 4, 2), BlockSizes(32, 64, 4, 2),
]  # fmt: skip
# the dk/dv kernel accumulates block_k key rows, the dq kernel block_q query rows
BWD_CANDIDATES = [
    BlockSizes(64, 32, 4, 3), BlockSizes(64, 32, 4, 2), BlockSizes(32, 32, 4, 2),
    BlockSizes(32, 64, 4, 2), BlockSizes(64, 64, 4, 2), BlockSizes(64, 64, 8, 2),
    BlockSizes(32, 32, 8, 2), BlockSizes(16, 64, 4, 2), BlockSizes(64, 16, 4, 2),
    BlockSizes(128, 32, 8, 2), BlockSizes(32, 16, 4, 2),
]  # fmt: skip
PASSES = {"fwd": FWD_CANDIDATES, "dkdv": BWD_CANDIDATES, "dq": BWD_CANDIDATES}


def _case(name, lengths, num_candidates, num_contextual, heads, dim, max_seqlen, rng):
    t = int(sum(lengths))
    q, k, v, g = (
        jnp.asarray(rng.standard_normal((t, heads, dim)), jnp.float32).astype(jnp.bfloat16)
        for _ in range(4)
    )
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    kw = dict(max_seqlen=max_seqlen, alpha=1.0 / dim**0.5, normalizer=float(max_seqlen))
    if num_contextual:
        kw["num_contextual"] = jnp.full((len(lengths),), num_contextual, jnp.int32)
    if num_candidates is not None:
        kw["num_candidates"] = jnp.asarray(num_candidates, jnp.int32)
    pairs = mask_pairs(lengths, num_contextual, num_candidates)
    return dict(name=name, qkv=(q, k, v), grad=g, offsets=offsets, kw=kw, pairs=pairs)


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def _programs(case, tiles):
    offsets, kw = case["offsets"], case["kw"]

    def fwd(q, k, v):
        return hstu_attention(q, k, v, offsets, **kw, block_sizes=tiles)

    def fwd_bwd(q, k, v, g):
        out, vjp = jax.vjp(fwd, q, k, v)
        return (out, *vjp(g))

    return jax.jit(fwd), jax.jit(fwd_bwd)


def _sweep_case(case, dim, heads, warmup, repeats, tol, calls=10):
    """Rows (kernel, BlockSizes, ms, note): every candidate of one kernel, the others'
    tiles at their defaults."""
    (q, k, v), g = case["qkv"], case["grad"]
    fwd_flops = 4.0 * case["pairs"] * heads * dim
    defaults = {kern: default_block_sizes(dim, kern) for kern in PASSES}

    def tiles_with(kern, bs):
        return tuple(bs if name == kern else defaults[name] for name in KERNELS)

    _, ref_fb = _programs(case, tiles_with("fwd", defaults["fwd"]))
    ref = ref_fb(q, k, v, g)
    rows = []
    for kern, candidates in PASSES.items():
        for bs in candidates:
            fwd, fwd_bwd = _programs(case, tiles_with(kern, bs))
            try:
                if kern == "fwd":
                    err = _rel_err(fwd(q, k, v), ref[0])
                else:
                    got = fwd_bwd(q, k, v, g)
                    err = max(_rel_err(a, b) for a, b in zip(got[1:], ref[1:], strict=True))
                if err > tol:
                    rows.append((kern, bs, float("nan"), f"differs: {err:.1e}"))
                    continue
                if kern == "fwd":
                    sec = _median_time(fwd, (q, k, v), warmup, repeats, calls)
                    flops = fwd_flops
                else:
                    sec = _median_time(fwd_bwd, (q, k, v, g), warmup, repeats, calls)
                    flops = 3.5 * fwd_flops
                rows.append((kern, bs, 1e3 * sec, f"{flops / sec / 1e12:.0f} TF/s"))
            except Exception as exc:  # e.g. a tile that does not fit in shared memory
                rows.append((kern, bs, float("nan"), type(exc).__name__))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dims", default="128,256")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10, help="calls back to back per repeat")
    ap.add_argument("--tol", type=float, default=2e-2, help="bf16 rel. error vs the default")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("tune needs a GPU")
    rng = np.random.default_rng(0)
    lengths, cand = bench_upstream_batch(rng, 32)
    print(f"# {jax.devices()[0].device_kind}, bf16, heads={args.heads}, jax {jax.__version__}")
    print(f"# jagged: 32 samples, {int(lengths.sum())} tokens, longest {int(lengths.max())}")
    for dim in (int(d) for d in args.dims.split(",")):
        equal = [args.seqlen] * args.batch
        cases = [
            _case(f"{args.batch}x{args.seqlen}", equal, None, 0, args.heads, dim, args.seqlen, rng),
            _case("jagged", lengths, cand, 4, args.heads, dim, MAX_SEQLEN, rng),
        ]
        results = {
            c["name"]: _sweep_case(
                c, dim, args.heads, args.warmup, args.repeats, args.tol, args.calls
            )
            for c in cases
        }
        defaults = ", ".join(f"{kern} {default_block_sizes(dim, kern)}" for kern in PASSES)
        print(f"\n## head dim {dim} (defaults: {defaults}; dkdv / dq rows: forward + backward)")
        print(sweep_table(results, PASSES, "q,k,warps,stages"))


if __name__ == "__main__":
    main()
