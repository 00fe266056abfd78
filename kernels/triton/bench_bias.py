"""Microbenchmark: what the attention biases cost the Triton HSTU kernel on CUDA.

    python -m hstu_kernels.triton.bench_bias [--seqlen 4096] [--batch 4] [--heads 4] [--dim 128]

One row per bias set-up (none; ``rab_pos`` with one bucket per distance or with a clamped last
bucket, in bf16 or fp32; ``rab_time`` with 16 or 32 buckets; both): forward,
forward + backward with the table gradients, and forward + backward without them. bf16 inputs,
causal mask, FLOPs as in ``bench`` (unmasked pairs; forward + backward = 3.5 x forward).
"""

import argparse

import torch

from .bench import _time_ms
from .hstu_attention import hstu_attention
from .reference import hstu_mask_reference


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


def _time_case(spec, q, k, v, grad, offsets, timestamps, gen, args):
    """(fwd, fwd+bwd with table gradients, fwd+bwd without them) median milliseconds."""
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

    return tuple(_time_ms(fn, args.warmup, args.repeats) for fn in (fwd, fwd_bwd, fwd_bwd_frozen))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_bias needs a CUDA device")

    dev = torch.device("cuda")
    n, b, h, d = args.seqlen, args.batch, args.heads, args.dim
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, grad = (
        torch.randn(n * b, h, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4)
    )
    offsets = torch.arange(b + 1, device=dev) * n
    timestamps = torch.randint(0, 100, (n * b,), device=dev, generator=gen).cumsum(0)
    fwd_flops = 4.0 * int(hstu_mask_reference(n, 0, 0, device=dev).sum()) * b * h * d

    print(f"# HSTU attention biases, {torch.cuda.get_device_name()}, batch={b} seqlen={n} "
          f"heads={h} dim={d} bf16 causal")  # fmt: skip
    head = (
        f"{'bias':<28} {'fwd ms':>8} {'TF/s':>6} {'f+b ms':>8} {'TF/s':>6} "
        f"{'f+b no table grad':>18}"
    )
    print(head)
    print("-" * len(head))
    for name, spec in _variants(n).items():
        f_ms, fb_ms, fz_ms = _time_case(spec, q, k, v, grad, offsets, timestamps, gen, args)
        print(
            f"{name:<28} {f_ms:>8.3f} {fwd_flops / f_ms / 1e9:>6.1f} {fb_ms:>8.3f} "
            f"{3.5 * fwd_flops / fb_ms / 1e9:>6.1f} {fz_ms:>18.3f}"
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
