"""Block-size sweep of the Triton HSTU attention kernels, per head dim (CUDA).

    python -m hstu_kernels.triton.tune [--dims 64,128,256] [--seqlen 4096 --batch 8]
        [--kernels fwd,dkdv,dq,fused,dq_stored] [--tiles m,n,warps,stages ...]

For every head dim: an equal-length batch (``batch`` x ``seqlen``, causal) and a jagged one
shaped like ``configs/bench_upstream.yaml`` (``hstu_kernels.tune_cases``). Each forward candidate
is timed forward only, each backward candidate backward only: forward + backward less the
forward at its default tiles, each the device time of ``--calls`` calls captured in one CUDA
graph (``bench.graph_time_ms``, median over ``--repeats`` replays; as the training step and
``scripts/attention_jagged.py`` run them: eager calls timed by events carry the host's launch
gaps, which moved the jagged batch's figures by up to 10 % between two runs). Every candidate's
output and gradients are first compared with the built-in default's (a tile that computes
something else is reported, never timed). ``fused`` rows time the fused backward
(``backward="fused"``, one kernel on the dk/dv tiles) and ``dq_stored`` rows the stored one
(``backward="stored"``, the candidate as its dq kernel's tiles), both against the split
default's gradients (explicit ``backward="split"`` for the other rows, whatever the head dim's
default mode).
The defaults in ``_launch.default_block_sizes`` come from this table.
"""

import argparse

import numpy as np
import torch
import triton

from ..tiles import KERNELS
from ..tune_cases import MAX_SEQLEN, bench_upstream_batch, mask_pairs, sweep_table
from ._launch import BlockSizes, default_block_sizes
from .bench import graph_time_ms
from .hstu_attention import hstu_attention

FWD_CANDIDATES = [
    BlockSizes(64, 64, 4, 3), BlockSizes(64, 64, 4, 2), BlockSizes(64, 32, 4, 3),
    BlockSizes(64, 32, 4, 2), BlockSizes(32, 64, 4, 2), BlockSizes(64, 64, 8, 2),
    BlockSizes(64, 64, 8, 3), BlockSizes(128, 64, 8, 2), BlockSizes(128, 32, 8, 2),
    BlockSizes(128, 32, 8, 3), BlockSizes(128, 64, 4, 2),
]  # fmt: skip
# the dk/dv and fused kernels accumulate BLOCK_N key rows, the dq kernel BLOCK_M query rows
BWD_CANDIDATES = [
    BlockSizes(64, 64, 4, 2), BlockSizes(64, 64, 8, 2), BlockSizes(64, 32, 4, 2),
    BlockSizes(64, 32, 4, 3), BlockSizes(64, 32, 4, 1), BlockSizes(64, 32, 8, 2),
    BlockSizes(32, 64, 4, 2), BlockSizes(32, 64, 8, 2), BlockSizes(32, 32, 4, 2),
    BlockSizes(32, 32, 8, 2), BlockSizes(128, 32, 8, 2), BlockSizes(64, 16, 4, 2),
    BlockSizes(16, 64, 4, 2), BlockSizes(32, 16, 4, 2),
    # dq at head dim 256: two CTAs per SM (112 KB of shared memory, 255 registers, no spills
    # offline); the default 64 x 32 x 3 holds one (160 KB)
    BlockSizes(64, 16, 4, 3),
    # dq at head dim 256 with tensor-descriptor loads: no spills offline, 224 KB
    BlockSizes(128, 32, 8, 3),
]  # fmt: skip
# the fused kernel adds one [D] dq row per query and key block atomically: wide key blocks too
FUSED_CANDIDATES = [
    *BWD_CANDIDATES, BlockSizes(64, 128, 8, 2), BlockSizes(32, 128, 8, 2),
    BlockSizes(32, 128, 4, 2),
]  # fmt: skip
PASSES = {
    "fwd": FWD_CANDIDATES, "dkdv": BWD_CANDIDATES, "dq": BWD_CANDIDATES,
    "fused": FUSED_CANDIDATES, "dq_stored": BWD_CANDIDATES,
}  # fmt: skip
# the backward mode each pass runs, and the slot of the (forward, dk/dv, dq) tiles it sets
MODES = {"fused": "fused", "dq_stored": "stored"}
SLOTS = {"fused": "dkdv", "dq_stored": "dq"}


def _case(name, lengths, num_candidates, num_contextual, heads, dim, max_seqlen):
    dev = torch.device("cuda")
    T = int(sum(lengths))
    q, k, v, g = (torch.randn(T, heads, dim, device=dev, dtype=torch.bfloat16) for _ in range(4))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=dev)
    kw = dict(max_seqlen=max_seqlen, alpha=1.0 / dim**0.5, normalizer=float(max_seqlen))
    pairs = mask_pairs(lengths, num_contextual, num_candidates)
    if num_contextual:
        kw["num_contextual"] = torch.full((len(lengths),), num_contextual, device=dev)
    if num_candidates is not None:
        kw["num_candidates"] = torch.tensor(num_candidates, device=dev)
    return dict(name=name, qkv=(q, k, v), grad=g, offsets=offsets, kw=kw, pairs=pairs)


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def _sweep_case(case, dim, heads, calls, repeats, tol, passes=tuple(PASSES), only=None):
    """Rows (kernel, BlockSizes, ms, note): every candidate of one kernel, the others' tiles
    at their defaults; forward timed alone, backward tiles by the backward alone (``fused`` /
    ``dq_stored``: that backward with the candidate as its tiles, checked against split's
    gradients)."""
    q, k, v = (x.detach().requires_grad_() for x in case["qkv"])
    offsets, kw, grad = case["offsets"], case["kw"], case["grad"]
    fwd_flops = 4.0 * case["pairs"] * heads * dim
    defaults = {kern: default_block_sizes(dim, kern) for kern in PASSES}

    def blocks(kern, bs):
        slot = SLOTS.get(kern, kern)  # e.g. the fused kernel runs on the dk/dv tiles
        return tuple(bs if name == slot else defaults[name] for name in KERNELS)

    def attention(tiles, backward="split"):
        return hstu_attention(q, k, v, offsets, **kw, block_sizes=tiles, backward=backward)

    def forward(tiles):
        with torch.no_grad():
            attention(tiles)

    ref_out = attention(blocks("fwd", defaults["fwd"]))
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad)
    # what the backward rows leave out of their forward + backward: the default forward
    fwd_ms = graph_time_ms(lambda: forward(blocks("fwd", defaults["fwd"])), calls, repeats)
    rows = []
    for kern in passes:
        for bs in PASSES[kern] if only is None else only:
            tiles = blocks(kern, bs)
            try:
                out = attention(tiles, MODES.get(kern, "split"))
                if kern == "fwd":
                    err = _rel_err(out, ref_out)
                else:
                    grads = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
                    err = max(_rel_err(a, b) for a, b in zip(grads, ref_grads, strict=True))
                if err > tol:
                    rows.append((kern, bs, float("nan"), f"differs: {err:.1e}"))
                    continue
                del out
                if kern == "fwd":
                    ms = graph_time_ms(lambda tiles=tiles: forward(tiles), calls, repeats)
                else:
                    mode = MODES.get(kern, "split")

                    def fwd_bwd(tiles=tiles, mode=mode):
                        torch.autograd.grad(attention(tiles, mode), (q, k, v), grad)

                    ms = graph_time_ms(fwd_bwd, calls, repeats) - fwd_ms
                flops = fwd_flops * (1.0 if kern == "fwd" else 2.5)
                rows.append((kern, bs, ms, f"{flops / ms / 1e9:.0f} TF/s"))
            except Exception as exc:  # e.g. triton's OutOfResources: report, go on
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                rows.append((kern, bs, float("nan"), f"{type(exc).__name__}: {first}"))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    ap.add_argument("--repeats", type=int, default=20, help="graph replays (median)")
    ap.add_argument("--tol", type=float, default=2e-2, help="bf16 rel. error vs the default")
    ap.add_argument("--kernels", default=",".join(PASSES), help="the passes to sweep")
    ap.add_argument(
        "--tiles", nargs="*", default=None, help="sweep these (m,n,warps,stages) instead"
    )
    args = ap.parse_args(argv)
    only = [BlockSizes(*(int(x) for x in t.split(","))) for t in args.tiles or []] or None
    passes = args.kernels.split(",")
    if unknown := set(passes) - set(PASSES):
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}, expected some of {list(PASSES)}")
    if not torch.cuda.is_available():
        raise SystemExit("tune needs a CUDA device")
    rng = np.random.default_rng(0)
    lengths, cand = bench_upstream_batch(rng, 32)
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, bf16, heads={args.heads}, triton {triton.__version__}")
    print(f"# jagged: 32 samples, {int(lengths.sum())} tokens, longest {int(lengths.max())}")
    for dim in (int(d) for d in args.dims.split(",")):
        cases = [
            _case(f"{args.batch}x{args.seqlen}", [args.seqlen] * args.batch, None, 0,
                  args.heads, dim, args.seqlen),
            _case("jagged", lengths, cand, 4, args.heads, dim, MAX_SEQLEN),
        ]  # fmt: skip
        results = {c["name"]: _sweep_case(c, dim, args.heads, args.calls, args.repeats, args.tol,
                                          passes, only) for c in cases}  # fmt: skip
        defaults = ", ".join(f"{kern} {default_block_sizes(dim, kern)}" for kern in PASSES)
        print(f"\n## head dim {dim} (defaults: {defaults}; backward rows: backward time)")
        print(sweep_table(results, passes, "m,n,warps,stages"))
        for name, rows in results.items():  # the table cuts a failure short: in full here
            for kern, bs, ms, note in rows:
                if ms != ms and not note.startswith("differs"):
                    print(f"# {name} {kern} {bs}: {note}")
        del cases
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
