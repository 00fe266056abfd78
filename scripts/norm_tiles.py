"""The LayerNorm backward kernel's tiles and load order (`kernels/triton/layer_norm.py`: rows
per program, rows per slice, warps; loads a slice ahead, or Triton's pipelining in 2 / 3 stages;
then the partials' sum's columns per program for the best of those) swept on one CUDA GPU
at the torch model's two uses per HSTU layer, bench_upstream's shape (T tokens x 1024, bf16):
the gated norm (`LN(out) * u`, u and its gradient strided columns of the [T, 4096] uvqk
activation) and the next layer's residual add and input norm (`add_layer_norm`, with `h`'s own
gradient and the output projection's bias). Each cell is device time per call (a CUDA graph of
20 calls replayed, `bench.graph_time_ms`); every tiling's dx / dgate are checked equal to the
default's within one bf16 rounding (a row's sums run in the tile's order) and its weight
gradients within fp32 rounding. Then the forward's tiles (rows per program, warps) at both
uses.

    python scripts/norm_tiles.py [--tokens 12288] [--rows 16 32 64] [--slices 2 4 8]
        [--warps 2 4 8] [--no-forward]
"""

from __future__ import annotations

import argparse
import itertools

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--slices", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--no-forward", action="store_true", help="the backward's sweep only")
    args = ap.parse_args(argv)
    from hstu_kernels.triton import layer_norm as ln
    from hstu_kernels.triton.bench import graph_time_ms

    torch.manual_seed(0)
    t, d = args.tokens, 1024
    dev = dict(device="cuda")
    bf = dict(dtype=torch.bfloat16, **dev)
    w, b, rb = torch.randn(d, **dev) * 0.1 + 1, torch.randn(d, **dev) * 0.1, torch.randn(d, **dev)
    uvqk = torch.randn(t, 4 * d, **bf)
    u = uvqk[:, :d]
    grad = torch.empty(t, 4 * d, **bf)
    out2, x, r, dy, dh = (torch.randn(t, d, **bf) for _ in range(5))
    _, _, mean_g, rstd_g = ln.forward(out2, w, b, 1e-6, g2=u)
    _, h, mean_h, rstd_h = ln.forward(x, w, b, 1e-6, r2=r, rb=rb)
    cases = {
        "gated": lambda: ln.backward(out2, w, b, mean_g, rstd_g, dy, g2=u, dg=grad[:, :d]),
        "add": lambda: ln.backward(h, w, b, mean_h, rstd_h, dy, dh2=dh, rb=rb),
    }
    default_rows, default_tiles = ln.ROWS_PER_PROGRAM, ln._tiles
    default_loads, default_sum = (ln.BWD_PREFETCH, ln.BWD_STAGES), ln._SUM_COLS
    bd = default_tiles(d)[1]
    want = {name: [x.clone() for x in fn() if x is not None] for name, fn in cases.items()}
    first = (default_rows, default_tiles(d)[0], default_tiles(d)[2], *default_loads, default_sum)
    combos = [first] + [
        (rows, br, warps, prefetch, stages, default_sum)
        for rows, br, warps, (prefetch, stages) in itertools.product(
            args.rows, args.slices, args.warps, ((False, 0), (True, 0), (False, 2), (False, 3))
        )
        if br <= rows and (rows, br, warps, prefetch, stages, default_sum) != first
    ]
    print(f"# {t} x {d} bf16; default: {first[0]} rows per program, {first[1]} per slice, "
          f"{first[2]} warps, prefetch {first[3]}, stages {first[4]}, {first[5]} columns per "
          "partials' sum program")  # fmt: skip
    head = f"{'rows':>5} {'slice':>5} {'warps':>5} {'pref':>5} {'stg':>3} {'sum':>4} "
    print(head + " ".join(f"{n + ' us':>10}" for n in cases))

    def time_combos(combos):
        results = []
        for combo in combos:
            rows, br, warps, prefetch, stages, sum_cols = combo
            ln.ROWS_PER_PROGRAM, ln._SUM_COLS = rows, sum_cols
            ln.BWD_PREFETCH, ln.BWD_STAGES = prefetch, stages
            ln._tiles = lambda _d, br=br, warps=warps: (br, bd, warps)
            cells = []
            for name, fn in cases.items():
                got = [x for x in fn() if x is not None]
                for i, (g, e) in enumerate(zip(got, want[name], strict=True)):
                    if i < 2 and g.shape[0] == t:  # dx, dgate: bf16, one rounding apart
                        torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-2)
                    else:
                        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-3)
                cells.append(graph_time_ms(fn, 20, args.rounds) * 1000)
            results.append((*combo, *cells))
            print(f"{rows:>5} {br:>5} {warps:>5} {prefetch!s:>5} {stages:>3} {sum_cols:>4} "
                  + " ".join(f"{c:>10.1f}" for c in cells))  # fmt: skip
        return results

    try:
        results = time_combos(combos)
        best = min(results, key=lambda r: sum(r[6:]))
        results += time_combos(
            [(*best[:5], cols) for cols in (4, 8, 32, 64) if cols != best[5]] + [first]
        )
    finally:
        ln.ROWS_PER_PROGRAM, ln._tiles, ln._SUM_COLS = default_rows, default_tiles, default_sum
        ln.BWD_PREFETCH, ln.BWD_STAGES = default_loads
    for i, name in enumerate(cases):
        best = min(results, key=lambda r: r[6 + i])
        print(f"best {name}: {best[:6]}: {best[6 + i]:.1f} us against {results[0][6 + i]:.1f} "
              f"(default; the default again at the end: {results[-1][6 + i]:.1f})")  # fmt: skip
    best = min(results, key=lambda r: sum(r[6:]))
    print(f"best both: {best[:6]}: {sum(best[6:]):.1f} us against {sum(results[0][6:]):.1f} "
          f"(default; again at the end: {sum(results[-1][6:]):.1f})")  # fmt: skip
    if args.no_forward:
        return
    forward = {
        "gated fwd": lambda: ln.forward(out2, w, b, 1e-6, g2=u)[0],
        "add fwd": lambda: ln.forward(x, w, b, 1e-6, r2=r, rb=rb)[:2],
    }
    want = {name: fn() for name, fn in forward.items()}
    print(f"{'rows':>5} {'warps':>5} " + " ".join(f"{n + ' us':>13}" for n in forward))
    results = []
    try:
        for br, warps in [default_tiles(d)[::2]] + list(
            itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16))
        ):
            ln._tiles = lambda _d, br=br, warps=warps: (br, bd, warps)
            cells = []
            for name, fn in forward.items():
                torch.testing.assert_close(fn(), want[name], rtol=1e-2, atol=1e-2)
                cells.append(graph_time_ms(fn, 20, args.rounds) * 1000)
            results.append((br, warps, *cells))
            print(f"{br:>5} {warps:>5} " + " ".join(f"{c:>13.1f}" for c in cells))
    finally:
        ln._tiles = default_tiles
    best = min(results, key=lambda r: sum(r[2:]))
    print(f"best forward: rows {best[0]}, warps {best[1]}: {sum(best[2:]):.1f} us against "
          f"{sum(results[0][2:]):.1f} (default)")  # fmt: skip


if __name__ == "__main__":
    main()
