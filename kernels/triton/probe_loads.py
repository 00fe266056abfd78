"""How the way a loop loads its tiles changes registers, spills and warp roles, offline:

    python -m hstu_kernels.triton.probe_loads [--dim 256] [--arch 90]

A probe for the next step of the Triton dq kernel (kernels/README.md, "Next for the Triton
forward and dq"), not a kernel the package runs. The loop has dq's shape: per program a
``[BLOCK_M, D]`` query and output-gradient tile held, then per key tile ``S = q k^T``,
``dP = dO v^T``, ``dS = dP * silu'(S)`` and ``acc += dS k``, without the masks, the jagged
schedule or the biases of the real kernel. It is compiled three ways for sm_``arch``a (no GPU
needed): tiles loaded through pointer tensors (as our kernels load them), through tensor
descriptors (TMA), and through descriptors with ``tl.range(warp_specialize=True)``; ptxas
reports registers and spills, the compiled kernel its shared memory and warp count (above the
launch's when Triton split the loop into a producer and consumers), and the PTX whether it
sets per-role register budgets (``setmaxnreg``). Figures depend on the Triton version: the
GPU image's compiler may decide differently from this machine's.
"""

import argparse

import triton
import triton.language as tl

from .resources import compile_report


@triton.jit
def _loop_body(acc, q, do, k, v, alpha, FWD: tl.constexpr):
    """One key tile: the forward's ``acc += silu(q k^T) v`` (FWD) or dq's ``acc += dS k``."""
    s = tl.dot(q, k.T) * alpha
    sig = tl.sigmoid(s)
    if FWD:
        out = tl.dot((s * sig).to(v.dtype), v, acc)
    else:
        ds = tl.dot(do, v.T) * sig * (1 + s * (1 - sig))
        out = tl.dot(ds.to(k.dtype), k, acc)
    return out


@triton.jit
def _slice(Q, K, V, DO, DQ, stride_b):
    """The program's ``[L, D]`` slice of each input (``program_id(1)``, ``stride_b`` apart)."""
    base = tl.program_id(1).to(tl.int64) * stride_b
    return Q + base, K + base, V + base, DO + base, DQ + base


@triton.jit
def _dq_loop_pointers(Q, K, V, DO, DQ, L, stride_t, stride_b, alpha,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      FWD: tl.constexpr):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    Q, K, V, DO, DQ = _slice(Q, K, V, DO, DQ, stride_b)
    rows_m = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    in_m = rows_m[:, None] < L
    q = tl.load(Q + rows_m[:, None] * stride_t + cols[None, :], mask=in_m, other=0.0)
    do = q
    if not FWD:
        do = tl.load(DO + rows_m[:, None] * stride_t + cols[None, :], mask=in_m, other=0.0)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in range(0, start_m, BLOCK_N):
        rows_n = start_n + tl.arange(0, BLOCK_N)
        in_n = rows_n[:, None] < L
        k = tl.load(K + rows_n[:, None] * stride_t + cols[None, :], mask=in_n, other=0.0)
        v = tl.load(V + rows_n[:, None] * stride_t + cols[None, :], mask=in_n, other=0.0)
        acc = _loop_body(acc, q, do, k, v, alpha, FWD)
    tl.store(
        DQ + rows_m[:, None] * stride_t + cols[None, :], acc.to(DQ.dtype.element_ty), mask=in_m
    )


@triton.jit
def _dq_loop_descriptors(Q, K, V, DO, DQ, L, stride_t, stride_b, alpha,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         FWD: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    Q, K, V, DO, DQ = _slice(Q, K, V, DO, DQ, stride_b)
    q_desc = tl.make_tensor_descriptor(
        Q, shape=[L, D], strides=[stride_t, 1], block_shape=[BLOCK_M, D]
    )
    do_desc = tl.make_tensor_descriptor(
        DO, shape=[L, D], strides=[stride_t, 1], block_shape=[BLOCK_M, D]
    )
    k_desc = tl.make_tensor_descriptor(
        K, shape=[L, D], strides=[stride_t, 1], block_shape=[BLOCK_N, D]
    )
    v_desc = tl.make_tensor_descriptor(
        V, shape=[L, D], strides=[stride_t, 1], block_shape=[BLOCK_N, D]
    )
    dq_desc = tl.make_tensor_descriptor(
        DQ, shape=[L, D], strides=[stride_t, 1], block_shape=[BLOCK_M, D]
    )
    q = q_desc.load([start_m, 0])
    do = q
    if not FWD:
        do = do_desc.load([start_m, 0])
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in tl.range(0, start_m, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        acc = _loop_body(acc, q, do, k, v, alpha, FWD)
    dq_desc.store([start_m, 0], acc.to(DQ.dtype.element_ty))


VARIANTS = ("pointers", "descriptors", "descriptors+ws")


def probe(variant: str, dim: int, block_m: int, block_n: int, num_warps: int,
          num_stages: int, arch: int = 90) -> dict:  # fmt: skip
    """Compile ``variant`` (one of VARIANTS) for sm_``arch``: registers, spill bytes, shared
    memory, the compiled warp count and the PTX's ``setmaxnreg`` count."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    fn = _dq_loop_pointers if variant == "pointers" else _dq_loop_descriptors
    consts = dict(D=dim, BLOCK_M=block_m, BLOCK_N=block_n, FWD=False)
    if fn is _dq_loop_descriptors:
        consts["WARP_SPECIALIZE"] = variant == "descriptors+ws"
    pointers = ("Q", "K", "V", "DO", "DQ")
    signature = {
        n: "constexpr" if n in consts else "*bf16" if n in pointers
        else "fp32" if n == "alpha" else "i32"
        for n in fn.arg_names
    }  # fmt: skip
    aligned = (*pointers, "stride_t", "stride_b")  # as a launch specializes them (resources.py)
    compiled, report = compile_report(fn, signature, consts, aligned, num_warps, num_stages, arch)
    return report | dict(warps=int(compiled.metadata.num_warps),
                         setmaxnreg=compiled.asm["ptx"].count("setmaxnreg"))  # fmt: skip


def time_variants(
    dim: int, length: int, batch: int, tiles: str, loop: str = "dq", repeats: int = 50
) -> list[dict]:
    """On the GPU: each variant of one tile (``block_m,block_n,warps,stages``) over ``batch``
    independent ``[length, dim]`` slices, checked against the pointer variant's output, then
    timed (``triton.testing.do_bench``, median ms) with its rate in TFLOP/s (3 matmuls of
    2 * block_m * block_n * dim per visited tile)."""
    import torch

    bm, bn, warps, stages = (int(x) for x in tiles.split(","))
    # device-side descriptors keep their TMA descriptors in a scratch buffer Triton asks for
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(batch, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
        for _ in range(4)
    )
    alpha = dim**-0.5
    grid = (triton.cdiv(length, bm), batch)
    tiles_visited = sum(triton.cdiv(m * bm, bn) for m in range(grid[0])) * batch
    flops = (2 if loop == "fwd" else 3) * 2 * bm * bn * dim * tiles_visited
    out, rows = {}, []
    for variant in VARIANTS:
        dq = torch.empty_like(q)
        consts = dict(
            D=dim, BLOCK_M=bm, BLOCK_N=bn, FWD=loop == "fwd", num_warps=warps, num_stages=stages
        )
        if variant == "pointers":
            fn = _dq_loop_pointers
        else:
            fn = _dq_loop_descriptors
            consts["WARP_SPECIALIZE"] = variant == "descriptors+ws"
        args = (q, k, v, do, dq, length, dim, length * dim, alpha)

        def launch(fn=fn, args=args, consts=consts):
            fn[grid](*args, **consts)

        try:
            launch()
            torch.cuda.synchronize()
        except Exception as e:  # a tile past the shared memory, a lowering this Triton lacks
            failed = f"{type(e).__name__}: {e}"
            rows.append(dict(loop=loop, variant=variant, tiles=tiles, failed=failed))
            continue
        out[variant] = dq.float()
        ref = out.get("pointers", out[variant])
        err = (out[variant] - ref).abs().max().item()
        ms = triton.testing.do_bench(launch, rep=repeats, return_mode="median")
        rows.append(
            dict(loop=loop, variant=variant, tiles=tiles, ms=ms, tflops=flops / ms / 1e9, err=err)
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100")
    ap.add_argument("--tiles", nargs="*", default=["64,32,4,2", "128,32,8,2"],
                    help="block_m,block_n,warps,stages")  # fmt: skip
    ap.add_argument(
        "--time",
        action="store_true",
        help="on a GPU: check and time each variant instead of compiling offline",
    )
    ap.add_argument("--length", type=int, default=4096, help="--time: rows per slice")
    ap.add_argument("--batch", type=int, default=32, help="--time: slices (samples x heads)")
    ap.add_argument("--loops", default="dq,fwd", help="--time: dq and / or the forward's loop")
    args = ap.parse_args(argv)
    if args.time:
        print(
            f"# triton {triton.__version__}, head dim {args.dim}, {args.batch} x "
            f"{args.length} rows, bf16 (median ms, TFLOP/s, max |diff| vs pointers)"
        )
        for loop in args.loops.split(","):
            for text in args.tiles:
                for r in time_variants(args.dim, args.length, args.batch, text, loop):
                    head = f"{loop:>4} {r['variant']:>15}  {text:>11}"
                    if "failed" in r:
                        print(f"{head}  failed: {r['failed'][:200]}")
                        continue
                    print(f"{head}  {r['ms']:8.3f} ms  {r['tflops']:6.1f}  {r['err']:.2e}")
        return
    print(f"# triton {triton.__version__}, sm_{args.arch}a, head dim {args.dim}, bf16, dq loop")
    print(f"{'loads':>15}  {'tiles':>11}  regs  spill st/ld B  smem KB  warps  setmaxnreg")
    for text in args.tiles:
        bm, bn, warps, stages = (int(x) for x in text.split(","))
        for variant in VARIANTS:
            r = probe(variant, args.dim, bm, bn, warps, stages, args.arch)
            spill = f"{r['spill_stores']}/{r['spill_loads']}"
            print(
                f"{variant:>15}  {text:>11}  {r['registers']:4d}  {spill:>12}  "
                f"{r['shared'] // 1024:7d}  {r['warps']:5d}  {r['setmaxnreg']:10d}"
            )


if __name__ == "__main__":
    main()
