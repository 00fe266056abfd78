"""Tiles of jax's Pallas SiLU-backward kernel (`kernels/pallas/silu_bwd.py`) on the GPU, at
bench_upstream's layer: the gradient in 4 column blocks of 1,024, `--tokens` rows, bf16, the
GEMM's output and the bias given apart (as `model._linear_silu_split` calls it). Each cell is
device-bound wall time per call (`--calls` calls dispatched back to back, the median of
`--rounds`), each tiling checked against the reference first; then the GB/s the call moves
(the gradient and `z` read, `dpre` written).

    python scripts/silu_tiles.py [--tokens 12288] [--rows 64 128 256] [--block-r 8 16 32]
        [--block-n 64 128 256] [--warps 4 8] [--interpret]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--block-r", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--interpret", action="store_true", help="the Pallas interpreter (CPU check)")
    args = ap.parse_args()
    from hstu_kernels.pallas import silu_bwd as k

    rng = np.random.default_rng(0)
    t, widths = args.tokens, (1024,) * 4
    grads = [jnp.asarray(rng.standard_normal((t, w)), jnp.bfloat16) for w in widths]
    z = jnp.asarray(rng.standard_normal((t, sum(widths))) * 3, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(sum(widths)), jnp.bfloat16)
    want, want_bias = k.silu_backward_reference(grads, z, bias)
    moved = 3 * t * sum(widths) * 2  # bytes: gradient and z read, dpre written
    default = (k.ROWS_PER_PROGRAM, k.BLOCK_R, k.BLOCK_N, k.WARPS)
    configs = [default] + [
        c
        for c in itertools.product(args.rows, args.block_r, args.block_n, args.warps)
        if c != default and c[1] <= c[0] and c[0] % c[1] == 0
    ]
    print(
        f"# {t} x {sum(widths)} bf16, 4 column blocks; default rows / slice / columns / warps "
        f"{default}"
    )
    print(f"{'rows':>5} {'slice':>5} {'cols':>5} {'warps':>5} {'us':>9} {'GB/s':>7}")
    results = {}
    for cfg in configs + [default]:
        k.ROWS_PER_PROGRAM, k.BLOCK_R, k.BLOCK_N, k.WARPS = cfg
        k.silu_backward.clear_cache()  # the tiles are read when the call is traced
        try:
            dpre, dbias = k.silu_backward(grads, z, bias, interpret=args.interpret)
            np.testing.assert_allclose(
                np.asarray(dpre, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
            )
            np.testing.assert_allclose(
                np.asarray(dbias), np.asarray(want_bias), rtol=1e-3, atol=0.5
            )
        except Exception as e:  # a tiling Triton cannot build: named, the sweep goes on
            print(f"{cfg[0]:>5} {cfg[1]:>5} {cfg[2]:>5} {cfg[3]:>5}  failed: {str(e)[:80]}")
            continue
        times = []
        for _ in range(args.rounds):
            jax.block_until_ready(k.silu_backward(grads, z, bias, interpret=args.interpret))
            t0 = time.perf_counter()
            for _ in range(args.calls):
                out = k.silu_backward(grads, z, bias, interpret=args.interpret)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / args.calls)
        us = statistics.median(times) * 1e6
        results.setdefault(cfg, []).append(us)
        print(f"{cfg[0]:>5} {cfg[1]:>5} {cfg[2]:>5} {cfg[3]:>5} {us:9.1f} {moved / us / 1e3:7.0f}")
    best = min(results, key=lambda c: min(results[c]))
    print(
        f"best: {best}: {min(results[best]):.1f} us against {results[default]} (default, "
        "first and last)"
    )
    print("BEST_TILES=" + ",".join(map(str, best)))  # read by scripts/gpu_check.sh silu


if __name__ == "__main__":
    main()
