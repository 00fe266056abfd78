"""Device time of the HSTU attention kernels on the batches the end-to-end recipe feeds them.

    python scripts/attention_jagged.py --backend torch|jax [--dim 256] [--heads 4]
        [--profile [CASE ...]]       (per-kernel device time of those cases; none named: all)
        [--lowering triton|mosaic]   (jax: the attention kernels' Pallas lowering)
        [--lead fwd=0 dq=33 ...]     (torch, or jax with mosaic: a kernel's launch order,
                                      ``BlockSizes.lead`` / ``MosaicTiles.lead``: its first N
                                      schedule entries with their heads together, the rest head
                                      by head; the others keep their default)
        [--equal 8x4096 16x1024 ...] (the equal-length batches timed after the recipe's)
        [--no-recipe]                (the equal-length batches only)
        [--backward split|fused|stored] (torch: two backward kernels, one with dq atomics, or
                                      two with dS stored by the first for the second's dq)
        [--tiles dkdv=32,64,8,2 ...] (torch: a kernel's tiles, m,n,warps,stages; jax with
                                      mosaic: block_kv,stages, e.g. fwd=32,3; the others keep
                                      their defaults)
        [--exact-rows]               (arrays of exactly the batch's tokens, not a capacity)

Cases: three jagged batches drawn like ``configs/bench_upstream.yaml`` (32 samples, 4
contextual tokens, 8..64 candidates, ``max_seqlen`` 4100: ``tune_cases``) and batches of
equal lengths (``--equal``, default one of 8 x 4096). Each cell is the median over rounds of
one round's time divided by its ``--calls`` calls: torch replays the calls captured in one
CUDA graph (as the training step runs them) between CUDA events; jax dispatches them back to
back inside a range of a ``jax.profiler`` trace and sums the device's busy time in it
(``hstu.jax_backend.device_time``; on a CPU, the host's clock). Either way the host's launch
work is not in the figure: it is what the kernels cost inside a training step. So are the
arrays: a training step's q, k, v hold its batch at a token capacity, a multiple of
``hstu.capacity.ALIGN`` (256) rows with the rows past the batch unused, and the cases' arrays
do too (``--exact-rows``: exactly the batch's tokens, as a direct call may pass them; the Mosaic
lowering then first copies q, k, v (dO) to a multiple of 8 rows, which its TMA copies need).
TFLOP/s count the pairs the mask lets through (forward 4 x pairs x heads x dim; forward +
backward 3x that).
The kernels are whichever ``hstu_kernels`` is importable: ``gpu_check.sh kab`` points it at
two trees in turn to time them side by side.
"""

import argparse

import numpy as np
from hstu_kernels.tune_cases import MAX_SEQLEN, bench_upstream_batch, mask_pairs

from hstu.capacity import ALIGN, align_up

CONTEXTUAL = 4


def cases(equal=((8, 4096),), recipe: bool = True):
    """(name, lengths, candidates or None, contextual, max_seqlen)."""
    out = []
    for seed in range(3 if recipe else 0):
        lengths, cand = bench_upstream_batch(np.random.default_rng(seed), 32)
        out.append((f"upstream seed {seed}", lengths, cand, CONTEXTUAL, MAX_SEQLEN))
    for batch, seqlen in equal:
        out.append((f"{batch} x {seqlen}", np.full(batch, seqlen), None, 0, seqlen))
    return out


def rows(lengths, exact: bool = False) -> int:
    """The arrays' rows for a batch of ``lengths``: its tokens rounded up to a multiple of
    ``ALIGN``, as a training step's capacities are, or exactly its tokens."""
    tokens = int(np.sum(lengths))
    return tokens if exact else align_up(tokens)


def _equal(text: str) -> tuple[int, int]:
    batch, seqlen = (int(x) for x in text.split("x"))
    if batch < 1 or seqlen < 1:
        raise argparse.ArgumentTypeError(f"--equal: expected BxS with B, S >= 1, got {text!r}")
    return batch, seqlen


def _graph_timer(calls: int, rounds: int):
    """Device ms per call: ``calls`` calls captured in one CUDA graph, replayed ``rounds``
    times between events (no host launch work in the figure)."""
    from hstu_kernels.triton.bench import graph_time_ms

    return lambda fn: graph_time_ms(fn, calls, rounds)


def _torch_tiles(tiles: dict, dim: int, lead: dict | None = None, backward: str | None = None):
    """The (forward, dk/dv, dq) BlockSizes: ``tiles`` (kernel -> (m, n, warps, stages)) over
    the defaults for ``dim`` (``backward``'s: "stored"'s dq kernel has its own), with ``lead``
    (kernel -> launch order, ``BlockSizes.lead``) set; None when both are empty (the kernels'
    own choice)."""
    lead = lead or {}
    if not tiles and not lead:
        return None
    import dataclasses

    from hstu_kernels.triton import BlockSizes
    from hstu_kernels.triton._launch import default_block_sizes

    slot = {"dq": "dq_stored"} if backward == "stored" else {}
    return tuple(
        dataclasses.replace(
            BlockSizes(*tiles[k]) if k in tiles else default_block_sizes(dim, slot.get(k, k)),
            lead=lead.get(k),
        )
        for k in ("fwd", "dkdv", "dq")
    )


def _parse_tiles(items: list[str], fields: int = 4) -> dict:
    """kernel -> ``fields`` ints: torch's m,n,warps,stages (4), Mosaic's block_kv,stages (2)."""
    what = "m,n,warps,stages" if fields == 4 else "block_kv,stages"
    out = {}
    for item in items:
        kernel, _, spec = item.partition("=")
        vals = spec.split(",")
        if (
            kernel not in ("fwd", "dkdv", "dq")
            or len(vals) != fields
            or not all(v.isdigit() for v in vals)
        ):
            raise SystemExit(f"--tiles: expected KERNEL={what}, KERNEL one of fwd, dkdv, dq; "
                             f"got {item!r}")  # fmt: skip
        out[kernel] = tuple(int(x) for x in vals)
    return out


def _torch_case(
    lengths, cand, ctx, max_seqlen, heads, dim, timed, profile=False, backward=None, tiles=None,
    exact_rows=False, lead=None,
):  # fmt: skip
    import torch
    from hstu_kernels.triton import hstu_attention  # the function, whatever loaded first

    dev = torch.device("cuda")
    T = rows(lengths, exact_rows)
    q, k, v, g = (torch.randn(T, heads, dim, device=dev, dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    offs = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=dev)
    kw = dict(max_seqlen=max_seqlen, alpha=1.0 / dim**0.5, normalizer=float(max_seqlen))
    if ctx:
        kw["num_contextual"] = torch.full((len(lengths),), ctx, device=dev)
    if cand is not None:
        kw["num_candidates"] = torch.tensor(cand, device=dev)
    if backward is not None:  # absent: the kernels' default (and a tree without the option)
        kw["backward"] = backward
    if tiles or lead:
        kw["block_sizes"] = _torch_tiles(tiles, dim, lead, backward)

    def fwd():
        with torch.no_grad():
            hstu_attention(q, k, v, offs, **kw)

    def fwd_bwd():
        out = hstu_attention(q, k, v, offs, **kw)
        torch.autograd.grad(out, (q, k, v), g)

    if profile:
        print("  -- forward")
        _torch_profile(fwd)
        print("  -- forward + backward")
        _torch_profile(fwd_bwd)
    return timed(fwd), timed(fwd_bwd)


def _torch_profile(fn, calls: int = 5):
    """Per-kernel device time of one call (torch.profiler, mean over ``calls``)."""
    from hstu_kernels.triton.bench import kernel_profile

    for name, ms, count in kernel_profile(fn, calls)[:6]:
        print(f"  {name[:48]:>48} {ms:8.3f} ms x{count}")


def _triton_resources():
    """Registers, spills and shared memory of each compiled Triton attention kernel."""
    from hstu_kernels.triton import _launch

    for fn in (
        _launch._hstu_fwd_kernel,
        _launch._hstu_bwd_dkdv_kernel,
        _launch._hstu_bwd_dq_kernel,
        _launch._hstu_bwd_dq_stored_kernel,
    ):
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for k in kernels.values():
                shared = getattr(k.metadata, "shared", "?")
                print(
                    f"  {fn.__name__}: {k.n_regs} registers, {k.n_spills} spills, {shared} B smem"
                )


def _jax_profile(fn, args, calls: int = 5) -> None:
    """Every device kernel and host thread of ``calls`` calls of ``fn`` (jax.profiler; per call):
    what the jagged wrappers add around the attention kernels."""
    import glob
    import os
    import tempfile

    import jax
    from profile_step import summarize_trace

    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="hstu-attn-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    jax.profiler.stop_trace()
    pattern = os.path.join(trace_dir, "**", "*.json.gz")
    summarize_trace(sorted(glob.glob(pattern, recursive=True))[-1], calls, top=12)


def _parse_lead(items: list[str]) -> dict:
    out = {}
    for item in items:
        kernel, _, n = item.partition("=")
        if kernel not in ("fwd", "dq", "dkdv") or not n.isdigit():
            raise SystemExit(f"--lead: expected KERNEL=N, KERNEL one of fwd, dq, dkdv and N >= 0; "
                             f"got {item!r}")  # fmt: skip
        out[kernel] = int(n)
    return out


def _mosaic_tiles(lead: dict, dim: int, tiles: dict | None = None):
    """The (forward, dq, dk/dv) MosaicTiles: ``tiles`` (kernel -> (block_kv, stages)) over the
    defaults for ``dim``, with ``lead`` (kernel -> entries launched with their heads) set; None
    when both are empty (the defaults)."""
    tiles = tiles or {}
    if not lead and not tiles:
        return None
    import dataclasses

    from hstu_kernels.pallas import _mosaic

    out = []
    for kind in _mosaic.KINDS:
        t = _mosaic.default_tiles(kind, dim, dim)
        if kind in tiles:
            t = dataclasses.replace(t, block_kv=tiles[kind][0], stages=tiles[kind][1])
        out.append(dataclasses.replace(t, lead=lead.get(kind)))
    return tuple(out)


def _mosaic_problem(lead: dict, dim: int, tiles: dict) -> None:
    """Refuse Mosaic tiles the kernels cannot take (shared memory, block_kv) before anything
    compiles, naming why."""
    import jax.numpy as jnp
    from hstu_kernels.pallas import _mosaic

    try:
        chosen = _mosaic_tiles(lead, dim, tiles)
    except ValueError as exc:
        raise SystemExit(f"--tiles: {exc}") from None
    why = _mosaic.supports(jnp.bfloat16, dim, dim, False, chosen)
    if why is not None and "tiles" in why:
        raise SystemExit(f"--tiles: {why}")


def _jax_case(
    lengths, cand, ctx, max_seqlen, heads, dim, calls, rounds, lowering="triton", profile=False,
    exact_rows=False, lead=None, tiles=None,
):  # fmt: skip
    import jax
    import jax.numpy as jnp
    from hstu_kernels.pallas import hstu_attention

    from hstu.jax_backend.device_time import time_ms

    key = jax.random.split(jax.random.key(0), 4)
    T = rows(lengths, exact_rows)
    q, k, v, g = (jax.random.normal(kk, (T, heads, dim), jnp.bfloat16) for kk in key)
    offs = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    kw = dict(max_seqlen=max_seqlen, alpha=1.0 / dim**0.5, normalizer=float(max_seqlen))
    extra = {}
    if ctx:
        extra["num_contextual"] = jnp.full((len(lengths),), ctx, jnp.int32)
    if cand is not None:
        extra["num_candidates"] = jnp.asarray(cand, jnp.int32)

    # the batch's arrays and dO are arguments, as in a training step: closed over, XLA folds
    # the kernels' schedule (and dO's padding) into the program at compile time
    def attn(q, k, v, offs, extra):
        return hstu_attention(
            q, k, v, offs, **kw, **extra, lowering=lowering,
            mosaic_tiles=_mosaic_tiles(lead or {}, dim, tiles),
        )  # fmt: skip

    def attn_and_grads(q, k, v, offs, extra, g):
        # the output is returned too: the backward does not read it, and a program that
        # returned the gradients alone let XLA drop the forward kernel from the figure
        out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, offs, extra), q, k, v)
        return out, pull(g)

    fwd = jax.jit(attn)
    fwd_bwd = jax.jit(attn_and_grads)

    if profile:
        print(f"  -- forward, {lowering} lowering")
        _jax_profile(fwd, (q, k, v, offs, extra))
        print(f"  -- forward + backward, {lowering} lowering")
        _jax_profile(fwd_bwd, (q, k, v, offs, extra, g))

    runs = {"fwd": (fwd, (q, k, v, offs, extra)), "fwd_bwd": (fwd_bwd, (q, k, v, offs, extra, g))}
    ms = time_ms(runs, calls, rounds)  # the device's time (a CPU: the host's clock)
    return ms["fwd"], ms["fwd_bwd"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", choices=["torch", "jax"], required=True)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20, help="calls back to back per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-recipe", dest="recipe", action="store_false",
                    help="leave out the recipe's three jagged batches")  # fmt: skip
    ap.add_argument("--equal", type=_equal, nargs="+", default=[(8, 4096)],
                    help="equal-length batches BxS after the recipe's")  # fmt: skip
    ap.add_argument("--profile", nargs="*", default=None, metavar="CASE",
                    help="per-kernel device time of these cases (none named: all)")  # fmt: skip
    ap.add_argument("--lowering", choices=["triton", "mosaic"], default="triton",
                    help="jax: the forward / dq kernels' Pallas lowering")  # fmt: skip
    ap.add_argument("--backward", choices=["split", "fused", "stored"], default=None,
                    help="torch: the backward kernels (default: the kernels' choice)")  # fmt: skip
    ap.add_argument("--tiles", nargs="*", default=[],
                    help="torch: KERNEL=m,n,warps,stages for fwd / dkdv / dq; jax mosaic: "
                         "KERNEL=block_kv,stages")  # fmt: skip
    ap.add_argument("--lead", nargs="*", default=[],
                    help="torch / jax mosaic: KERNEL=N, the launch order (lead)")  # fmt: skip
    ap.add_argument("--exact-rows", action="store_true",
                    help="arrays of exactly the batch's tokens (default: a capacity)")  # fmt: skip
    args = ap.parse_args(argv)
    mosaic = args.backend == "jax" and args.lowering == "mosaic"
    if args.tiles and args.backend == "jax" and not mosaic:
        raise SystemExit("--tiles: torch's Triton kernels or the Mosaic ones (--lowering mosaic)")
    tiles = _parse_tiles(args.tiles, 2 if mosaic else 4)
    lead = _parse_lead(args.lead)
    if lead and args.backend == "jax" and not mosaic:
        raise SystemExit(
            "--lead: the launch order of torch's Triton kernels or of the Mosaic ones "
            "(--backend jax --lowering mosaic)"
        )
    if mosaic and tiles:
        _mosaic_problem(lead, args.dim, tiles)
    fwd_name = f", {args.lowering} lowering" if args.backend == "jax" else ""
    if lead:
        fwd_name += ", lead " + " ".join(args.lead)
    if args.backend == "torch" and args.backward:
        fwd_name = f", {args.backward} backward"
    if tiles:
        fwd_name += ", tiles " + " ".join(args.tiles)
    layout = "exact rows" if args.exact_rows else f"rows: tokens up to a multiple of {ALIGN}"
    print(f"# {args.backend}{fwd_name}, bf16, heads {args.heads}, dim {args.dim}, "
          f"{args.calls} calls x {args.rounds} rounds, {layout}")  # fmt: skip
    print(f"{'case':>16} {'tokens':>7} {'fwd ms':>8} {'TF/s':>5} {'f+b ms':>8} {'TF/s':>5}")
    timed = _graph_timer(args.calls, args.rounds) if args.backend == "torch" else None
    for name, lengths, cand, ctx, max_seqlen in cases(args.equal, args.recipe):
        shape = (lengths, cand, ctx, max_seqlen, args.heads, args.dim)
        profile = args.profile is not None and (not args.profile or name in args.profile)
        if args.backend == "torch":
            f_ms, fb_ms = _torch_case(
                *shape, timed, profile, args.backward, tiles, args.exact_rows, lead
            )
        else:
            f_ms, fb_ms = _jax_case(
                *shape, args.calls, args.rounds, args.lowering, profile, args.exact_rows, lead,
                tiles,
            )  # fmt: skip
        flops = 4.0 * mask_pairs(lengths, ctx, cand) * args.heads * args.dim
        print(f"{name:>16} {int(lengths.sum()):>7} {f_ms:8.3f} {flops / f_ms / 1e9:5.0f} "
              f"{fb_ms:8.3f} {3 * flops / fb_ms / 1e9:5.0f}")  # fmt: skip
    if args.profile is not None and args.backend == "torch":
        _triton_resources()


if __name__ == "__main__":
    main()
