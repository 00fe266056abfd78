"""jax's two LayerNorms of an HSTU layer, XLA's fusions of flax's norm against the Pallas kernels
(`hstu_kernels.pallas.layer_norm`), in device time on one GPU at bench_upstream's shape (T tokens
x 1024, bf16): the input norm with the residual stream passed through (its skip gradient added
in the backward) and the gated norm `LN(a) * u`. Each case is checked first (the kernels'
outputs and gradients against flax's and autodiff's, within bf16 rounding), then timed
forward and forward + backward (`hstu.jax_backend.device_time.device_ms`: the device's busy
time per call over bursts of calls, medians over rounds). `--sweep` also times the kernels'
tiles (rows per backward program, rows per slice, warps, the backward's stages).

In the model the gated norm's input is the attention's output, gathered from the Mosaic
kernels' tiles: XLA fuses that gather into flax's norm kernels, and the Pallas kernel reads it
materialised (a copy XLA adds in front of it). Here both read a plain array, so the gated row
leaves that copy out: the step's A/B (`bash scripts/gpu_check.sh jnorm`, the step without
the kernels, `model.fused_norm=false`, against it with them) is the figure that counts.

    python scripts/norm_kernels_jax.py [--tokens 11264] [--calls 20] [--rounds 5] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

EPS = 1e-6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=11264)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="the kernels' tiles too")
    ap.add_argument("--interpret", action="store_true", help="CPU: check only, in the interpreter")
    args = ap.parse_args(argv)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from hstu_kernels.pallas import layer_norm as kn

    from hstu.jax_backend.device_time import device_ms

    t, d, bf = args.tokens, args.dim, jnp.bfloat16
    rng = np.random.default_rng(0)
    x, u, a, dy, dres = (jnp.asarray(rng.standard_normal((t, d)), bf) for _ in range(5))
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal(d), jnp.float32)
    ln = nn.LayerNorm(epsilon=EPS, use_fast_variance=False, dtype=jnp.float32)

    def flax_norm(x, w, b):
        return ln.apply({"params": {"scale": w, "bias": b}}, x)

    def make(kernel: bool):
        """{case: (forward fn, forward + backward fn)} of one path."""
        if kernel:
            res = lambda x, w, b: kn.norm_residual(x, w, b, EPS, bf, args.interpret)  # noqa: E731
            gated = lambda a, u, w, b: kn.gated_norm(a, u, w, b, EPS, bf, args.interpret)  # noqa: E731
        else:
            res = lambda x, w, b: (flax_norm(x, w, b).astype(bf), x)  # noqa: E731
            gated = lambda a, u, w, b: (flax_norm(a, w, b) * u).astype(bf)  # noqa: E731

        def res_both(x, w, b):
            out, vjp = jax.vjp(res, x, w, b)
            return out[0], *vjp((dy, dres))

        def gated_both(a, u, w, b):
            out, vjp = jax.vjp(gated, a, u, w, b)
            return out, *vjp(dy)

        return {
            "input norm + residual": (jax.jit(res), jax.jit(res_both), (x, w, b)),
            "gated norm": (jax.jit(gated), jax.jit(gated_both), (a, u, w, b)),
        }

    def kernel_path(forward: str):
        """The kernels' path with their forwards as `forward` says (`layer_norm.FORWARD`),
        each function traced and compiled while it says so (jit keeps that trace)."""
        saved, kn.FORWARD = kn.FORWARD, forward
        try:
            cases = make(True)
            for fwd, both, inputs in cases.values():
                jax.block_until_ready((fwd(*inputs), both(*inputs)))
        finally:
            kn.FORWARD = saved
        return cases

    # "pallas": both passes the kernels'; "pallas bwd": the forwards XLA's, the backward kernels
    paths = {"xla": make(False), "pallas": kernel_path("kernel"), "pallas bwd": kernel_path("xla")}
    for case in paths["xla"]:
        _, want_fn, inputs = paths["xla"][case]
        for path in ("pallas", "pallas bwd"):
            got = paths[path][case][1](*inputs)
            for g, r in zip(got, want_fn(*inputs), strict=True):
                g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
                err = float(np.abs(g - r).max()) / max(float(np.abs(r).max()), 1e-6)
                if err > 2e-2:
                    raise SystemExit(f"{case}, {path}: {err:.3g} (relative) from flax's")
        print(f"checked: {case}")
    if args.interpret:
        return

    runs = {}
    for path, cases in paths.items():
        for case, (fwd, both, inputs) in cases.items():
            runs[f"{case} | {path} | fwd"] = (fwd, inputs)
            runs[f"{case} | {path} | fwd+bwd"] = (both, inputs)
    ms = device_ms(runs, args.calls, args.rounds)
    if ms is None:
        raise SystemExit("no device events in the trace (not a GPU?)")
    print(f"\n{t} x {d} bf16, device ms per call (median of {args.rounds} rounds)")
    print(f"{'case':<24} {'pass':<8} " + " ".join(f"{p:>11}" for p in paths) + "  (/ xla)")
    for case in paths["xla"]:
        for part in ("fwd", "fwd+bwd"):
            got = [ms[f"{case} | {p} | {part}"] for p in paths]
            ratios = " ".join(f"{v / got[0]:6.3f}" for v in got[1:])
            print(f"{case:<24} {part:<8} " + " ".join(f"{v:11.4f}" for v in got) + f"  {ratios}")

    if args.sweep:
        saved = kn.ROWS_PER_PROGRAM, kn._tiles, kn.BWD_STAGES
        sweep = {}
        grid = itertools.product((32, 64, 128), (2, 4, 8), (4, 8), (1, 3))
        for rows, block_r, warps, stages in grid:
            kn.ROWS_PER_PROGRAM, kn.BWD_STAGES = rows, stages
            kn._tiles = lambda _d, br=block_r, wp=warps: (br, wp)
            cases = make(True)
            for case, (_, both, inputs) in cases.items():
                jax.block_until_ready(both(*inputs))  # traced and compiled with these tiles
                sweep[f"{case} | {rows},{block_r},{warps},{stages}"] = (both, inputs)
        kn.ROWS_PER_PROGRAM, kn._tiles, kn.BWD_STAGES = saved
        ms = device_ms(sweep, args.calls, args.rounds)
        print("\nkernels' tiles (rows per backward program, rows per slice, warps, backward")
        print("stages), fwd+bwd ms")
        for name, v in sorted(ms.items(), key=lambda kv: kv[1]):
            print(f"  {name:<40} {v:8.4f}")


if __name__ == "__main__":
    main()
