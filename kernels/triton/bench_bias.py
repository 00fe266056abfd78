"""Microbenchmark: what the attention biases cost the Triton HSTU kernel on CUDA.

    python -m hstu_kernels.triton.bench_bias [--seqlen 4096] [--batch 4] [--heads 4] [--dim 128]
        [--dtype bf16] [--kernels] [--only time,pos]

One row per bias set-up (none; ``rab_pos`` with one bucket per distance or with a clamped last
bucket, in bf16 or fp32; ``rab_time`` with 16 or 32 buckets; both): forward, forward + backward
with the table gradients, and forward + backward without them. bf16 inputs (``--dtype``),
causal mask, FLOPs as in ``bench`` (unmasked pairs; forward + backward = 3.5 x forward).
Device time: each cell is the median over ``--repeats`` replays of ``--calls`` calls captured
in one CUDA graph (``bench.graph_time_ms``), so the host's launch work is not in it; the ratio
column is forward + backward with the table gradients over the no-bias row's.
``--kernels`` adds, per set-up, forward + backward with the table gradients split by kernel
(torch.profiler, ms per call): the forward, dk/dv and dq kernels and everything else.
"""

import argparse

import torch

from .bench import _DTYPES, graph_time_ms, kernel_profile
from .hstu_attention import hstu_attention
from .reference import hstu_mask_reference

# kernel name -> column of the --kernels table (first match; the rest is "other")
_KERNEL_GROUPS = (("_hstu_fwd", "fwd"), ("_hstu_bwd_dkdv", "dk/dv"), ("_hstu_bwd_dq", "dq"))


def _variants(seqlen: int) -> dict[str, dict]:
    bf16, fp32 = torch.bfloat16, torch.float32
    return {
        "none": {},
        f"pos P={seqlen} bf16": dict(rab_pos=(seqlen, bf16)),
        f"pos P={seqlen} fp32": dict(rab_pos=(seqlen, fp32)),
        "pos P=128 bf16 (clamped)": dict(rab_pos=(128, bf16)),
        "time TB=16 bf16": dict(rab_time=(16, bf16)),
        "time TB=32 bf16": dict(rab_time=(32, bf16)),
        f"pos P={seqlen} + time TB=16": dict(rab_pos=(seqlen, bf16), rab_time=(16, bf16)),
    }


def _calls(spec, q, k, v, grad, offsets, timestamps, gen, args):
    """(fwd, fwd+bwd with table gradients, fwd+bwd without them) as functions of no args."""
    n, h = args.seqlen, args.heads
    kw = dict(max_seqlen=n, alpha=1.0 / args.dim**0.5, normalizer=float(n))
    tables = {
        key: torch.randn(h, size, device=q.device, dtype=dtype, generator=gen)
        for key, (size, dtype) in spec.items()
    }
    if "rab_time" in tables:
        kw["timestamps"] = timestamps
    frozen = dict(kw, **tables)
    trained = dict(kw, **{key: t.clone().requires_grad_() for key, t in tables.items()})
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    table_leaves = [trained[key] for key in tables]

    def fwd():
        with torch.no_grad():
            return hstu_attention(*leaves, offsets, **frozen)

    def fwd_bwd():
        out = hstu_attention(*leaves, offsets, **trained)
        return torch.autograd.grad(out, leaves + table_leaves, grad)

    def fwd_bwd_frozen():
        return torch.autograd.grad(hstu_attention(*leaves, offsets, **frozen), leaves, grad)

    return fwd, fwd_bwd, fwd_bwd_frozen


def _by_kernel(fn, calls: int) -> dict[str, float]:
    """Device ms per call of ``fn`` by ``_KERNEL_GROUPS`` column, plus "other"."""
    out = dict.fromkeys([col for _, col in _KERNEL_GROUPS] + ["other"], 0.0)
    for name, ms, _ in kernel_profile(fn, calls):
        col = next((c for key, c in _KERNEL_GROUPS if key in name), "other")
        out[col] += ms
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="q, k, v")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--repeats", type=int, default=10, help="graph replays (median)")
    ap.add_argument("--kernels", action="store_true", help="add the per-kernel table")
    ap.add_argument("--only", default="", help="comma-separated substrings of row names")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_bias needs a CUDA device")

    dev = torch.device("cuda")
    n, b, h, d = args.seqlen, args.batch, args.heads, args.dim
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, grad = (
        torch.randn(n * b, h, d, device=dev, dtype=_DTYPES[args.dtype], generator=gen)
        for _ in range(4)
    )
    offsets = torch.arange(b + 1, device=dev) * n
    timestamps = torch.randint(0, 100, (n * b,), device=dev, generator=gen).cumsum(0)
    fwd_flops = 4.0 * int(hstu_mask_reference(n, 0, 0, device=dev).sum()) * b * h * d
    variants = _variants(n)
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        variants = {k: v for k, v in variants.items() if k == "none" or any(s in k for s in keep)}

    print(f"# HSTU attention biases, {torch.cuda.get_device_name()}, batch={b} seqlen={n} "
          f"heads={h} dim={d} {args.dtype} causal; device ms per call, median of {args.repeats} "
          f"replays of {args.calls} graphed calls")  # fmt: skip
    head = (
        f"{'bias':<28} {'fwd ms':>8} {'TF/s':>6} {'f+b ms':>8} {'TF/s':>6} {'x none':>7} "
        f"{'f+b no table grad':>18}"
    )
    print(head)
    print("-" * len(head))
    kernels, base = {}, None
    for name, spec in variants.items():
        fns = _calls(spec, q, k, v, grad, offsets, timestamps, gen, args)
        f_ms, fb_ms, fz_ms = (graph_time_ms(fn, args.calls, args.repeats) for fn in fns)
        base = fb_ms if base is None else base
        print(
            f"{name:<28} {f_ms:>8.3f} {fwd_flops / f_ms / 1e9:>6.1f} {fb_ms:>8.3f} "
            f"{3.5 * fwd_flops / fb_ms / 1e9:>6.1f} {fb_ms / base:>6.2f}x {fz_ms:>18.3f}"
        )
        if args.kernels:
            kernels[name] = _by_kernel(fns[1], args.calls)
        del fns
        torch.cuda.empty_cache()
    if kernels:
        cols = list(next(iter(kernels.values())))
        print("\n# forward + backward with the table gradients, device ms per call by kernel")
        print(f"{'bias':<28} " + " ".join(f"{c:>8}" for c in cols))
        for name, row in kernels.items():
            print(f"{name:<28} " + " ".join(f"{row[c]:>8.3f}" for c in cols))


if __name__ == "__main__":
    main()
