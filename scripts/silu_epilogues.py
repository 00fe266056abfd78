"""The HSTU layer's projection, SiLU, attention and gated norm, forward + backward, two ways:
`hstu_linear_uvqk_attention` (SiLU's backward in the kernels' epilogues, `model.silu_epilogues`)
against `linear_silu` then `hstu_uvqk_attention(norm=...)` (its own SiLU-backward kernel), on one
CUDA GPU, at bench_upstream's layer (hidden 1024, 4 heads x 256, bf16) and a jagged batch of
Zipf(1.2) lengths. Prints the median time of each (CUDA events, alternating rounds) and the
device time per kernel of each (torch.profiler), so a difference is named by kernel.

    python scripts/silu_epilogues.py [--tokens 11000] [--batch 32] [--iters 20]
"""

from __future__ import annotations

import argparse
import collections
import statistics

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile


def jagged_offsets(batch: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Offsets of `batch` Zipf(1.2) lengths (16..4096) scaled to about `tokens` in total."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.zipf(1.2, batch) * 16, 16, 4096).astype(np.float64)
    lengths = np.clip(np.round(lengths * tokens / lengths.sum()), 1, 4096).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return torch.tensor(offsets, device="cuda"), int(lengths.max())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=11000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from hstu_kernels.triton import hstu_linear_uvqk_attention, hstu_uvqk_attention
    from hstu_kernels.triton.linear_silu import linear_silu

    torch.manual_seed(0)
    heads, dim, d_in = 4, 256, 1024
    width = heads * 4 * dim
    offsets, max_len = jagged_offsets(args.batch, args.tokens)
    t = int(offsets[-1])
    x = torch.randn(t, d_in, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(d_in, width, device="cuda") * 0.03).requires_grad_()
    b = (torch.randn(width, device="cuda") * 0.1).requires_grad_()
    nw = torch.ones(heads * dim, device="cuda", requires_grad=True)
    nb = torch.zeros(heads * dim, device="cuda", requires_grad=True)
    dy = torch.randn(t, heads * dim, device="cuda", dtype=torch.bfloat16)
    kw = dict(num_heads=heads, linear_dim=dim, attention_dim=dim, max_seqlen=max_len,
              alpha=dim**-0.5, normalizer=128.0)  # fmt: skip
    params = (x, w, b, nw, nb)

    def forward(epilogues: bool) -> torch.Tensor:
        if epilogues:
            return hstu_linear_uvqk_attention(x, w, b, offsets, norm=(nw, nb, 1e-6), **kw)
        return hstu_uvqk_attention(linear_silu(x, w, b), offsets, norm=(nw, nb, 1e-6), **kw)

    def step(epilogues: bool) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(forward(epilogues), params, dy)

    variants = {"epilogues": True, "silu kernel": False}
    outs = {name: step(on) for name, on in variants.items()}  # warm-up; the gradients compared
    for pname, g1, g2 in zip(["x", "w", "b", "nw", "nb"], *outs.values(), strict=True):
        err = float((g1.float() - g2.float()).abs().max() / g2.float().abs().max())
        print(f"# d{pname}: max |diff| / max |ref| = {err:.2e}")
    times = collections.defaultdict(list)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for name, on in variants.items():
            for _ in range(args.iters):
                start.record()
                step(on)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    print(f"# {t} tokens, {args.batch} samples (max {max_len}), hidden {d_in}, {heads} x {dim}")
    for name in variants:
        print(f"{name:>12}: median {statistics.median(times[name]):.3f} ms fwd+bwd "
              f"({len(times[name])} steps, host-timed with events)")  # fmt: skip
    per = {}
    for name, on in variants.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                step(on)
            torch.cuda.synchronize()
        per[name] = collections.Counter()
        for e in prof.key_averages():  # the kernels (their device rows), not the ops above them
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[name][e.key] += e.device_time_total / args.iters
    names = sorted(
        set().union(*per.values()), key=lambda k: -max(p.get(k, 0) for p in per.values())
    )
    print(f"{'kernel':<72} {'epilogues us':>13} {'silu kernel us':>15}")
    for k in names[:30]:
        print(f"{k[:72]:<72} {per['epilogues'][k]:>13.1f} {per['silu kernel'][k]:>15.1f}")
    for name in variants:
        print(f"device total {name}: {sum(per[name].values()) / 1000:.3f} ms per fwd+bwd")


if __name__ == "__main__":
    main()
