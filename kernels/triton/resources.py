"""Registers, spills and shared memory of the Triton attention kernels, compiled for a GPU the
machine need not have:

    python -m hstu_kernels.triton.resources [--dim 256] [--arch 90]
        [--kernels fwd,dkdv,dq,fused,dq_stored] [--tiles 64,32,4,2 ...] [--stored]

Kernels: ``fwd``, the split backward's ``dkdv`` and ``dq``, ``fused`` (the fused backward's one
kernel: dk/dv plus dq added atomically into fp32) and ``dq_stored`` (the "stored" backward's dq from
dS; ``--stored``: ``dkdv`` as that backward runs it, storing dS). Each kernel is compiled as
bench_upstream calls it (bf16, contextual and candidate counts, no biases, fast sigmoid) with its
default tiles and any ``--tiles`` given, and ptxas reports registers per thread and spill bytes for
the PTX. At head dim 256 every kernel sits at the 255-register limit and spills (kernels/README.md),
so this is how a change to the tiles or to a kernel's code is judged on a CPU machine before it is
timed on a GPU (``scripts/attention_jagged.py --profile`` reads the same from the kernels it
loaded). Figures depend on the Triton and ptxas versions: compare variants within one install. Needs
Triton kernels compiled, not interpreted (``TRITON_INTERPRET`` unset).
"""

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ._backward import (
    _hstu_bwd_dkdv_kernel,
    _hstu_bwd_dq_kernel,
    _hstu_bwd_dq_stored_kernel,
    _hstu_bwd_fused_kernel,
)
from ._forward import _hstu_fwd_kernel
from ._launch import _TMA_KERNELS, TILE_KERNELS, BlockSizes, _block_d, default_block_sizes

_FN = {"fwd": _hstu_fwd_kernel, "dkdv": _hstu_bwd_dkdv_kernel, "dq": _hstu_bwd_dq_kernel,
       "fused": _hstu_bwd_fused_kernel, "dq_stored": _hstu_bwd_dq_stored_kernel}  # fmt: skip
# pointer arguments by name; every other non-constexpr argument is an int32 scalar except these
_POINTERS = {
    **dict.fromkeys(
        ("Q", "K", "V", "Out", "DO", "DK", "DVout", "DQ", "PreQ", "PreK", "PreV", "DS", "Zero"),
        "*bf16",
    ),
    **dict.fromkeys(
        ("SeqOffsets", "Ts", "TsRange", "RabPos", "RabTime", "DRabPos", "DRabTime"), "*i64"
    ),
    **dict.fromkeys(("NumCtx", "NumCand", "Sched"), "*i32"),
    **dict.fromkeys(("DQacc", "BPart", "BPartK", "BPartV"), "*fp32"),
}  # absent tables are passed as the int64 offsets, as the launches do
_FLOATS = ("alpha", "inv_norm")


def _ptxas_candidates() -> list[str]:
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    names = [os.environ.get("TRITON_PTXAS_PATH", "")]
    names += [os.path.join(here, n) for n in ("ptxas-blackwell", "ptxas")]
    return [n for n in names if n and os.path.exists(n)]


def _ptxas_report(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from the first ptxas that takes it."""
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for ptxas in _ptxas_candidates():
            cmd = [ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(tmp, "k.cubin")]
            out = subprocess.run(cmd, capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", out.stderr)
            if out.returncode == 0 and regs:
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
                stores, loads = (int(x) for x in spill.groups()) if spill else (0, 0)
                return int(regs.group(1)), stores, loads
            errors.append(f"{os.path.basename(ptxas)}: {out.stderr.strip()[-200:]}")
    raise RuntimeError("no ptxas compiled the kernel: " + " | ".join(errors or ["none found"]))


def resources(
    kernel: str,
    dim: int,
    tiles: BlockSizes,
    arch: int = 90,
    tma: bool | None = None,
    silu: bool = False,
    stored: bool = False,
) -> dict:
    """Compile ``kernel`` for head dim ``dim`` with ``tiles`` for sm_``arch``: registers per
    thread, spill store / load bytes per thread, shared memory bytes. ``tma``: the kernel loads
    through tensor descriptors (else pointer tiles); None: as the launch does on Hopper
    (``HSTU_TRITON_TMA``, by default the forward and dq). ``silu``: the backward kernels with
    SiLU's backward in their epilogues (``_bwd_impl(silu=...)``). ``stored``: dkdv storing dS
    for the "stored" backward's dq kernel (``dq_stored``)."""
    fn = _FN[kernel]
    if tma is None:
        tma = kernel in _TMA_KERNELS
    consts = dict(
        DQK=dim, DV=dim, BLOCK_DQK=_block_d(dim), BLOCK_DV=_block_d(dim),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_TB=16, HAS_CTX=True, HAS_CAND=True,
        HAS_POS=False, HAS_TIME=0, POS_GRAD=0, TIME_GRAD=False, PREC=None, FAST=True,
        OUT_LIKE_IN=True,  # the outputs share the inputs' strides (the model's case)
        TMA=tma, SILU=silu, SILU_TMA=silu, STORE_DS=stored,
        ZERO_TAIL=True, TAIL_ROWS=64, TAIL_COLS=256,  # the capacity padding zeroed as launched
    )  # fmt: skip
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    signature = {
        name: "constexpr" if name in consts
        else _POINTERS.get(name, "fp32" if name in _FLOATS else "i32")
        for name in fn.arg_names
    }  # fmt: skip
    # As a launch specializes them: torch's allocations are 16-byte aligned and the model's
    # strides are multiples of 16 elements, so Triton compiles the kernels with those facts
    # (vectorized, pipelined loads); without them the report describes a kernel that never runs.
    aligned = [n for n in fn.arg_names if n in _POINTERS or n.startswith("stride")]
    return compile_report(fn, signature, consts, aligned, tiles.num_warps, tiles.num_stages, arch)[
        1
    ]


def compile_report(fn, signature: dict, consts: dict, aligned, num_warps: int, num_stages: int,
                   arch: int = 90):  # fmt: skip
    """Compile the jitted ``fn`` for sm_``arch`` (``aligned``: arguments a launch would see
    16-divisible): (the compiled kernel, its registers per thread, spill store / load bytes
    per thread and shared memory bytes)."""
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    regs, stores, loads = _ptxas_report(compiled.asm["ptx"], arch)
    return compiled, dict(registers=regs, spill_stores=stores, spill_loads=loads,
                          shared=int(compiled.metadata.shared))  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100")
    ap.add_argument("--kernels", default=",".join(TILE_KERNELS))
    ap.add_argument(
        "--tiles", nargs="*", default=[], help="extra tiles: block_m,block_n,warps,stages"
    )
    ap.add_argument(
        "--loads",
        choices=("launch", "tma", "pointers"),
        default="launch",
        help="tile loads of every kernel (launch: each kernel's as HSTU_TRITON_TMA sets them)",
    )
    ap.add_argument(
        "--silu", action="store_true", help="the backward kernels with SiLU's backward in them"
    )
    ap.add_argument("--stored", action="store_true", help='dkdv storing dS (the "stored" backward)')
    args = ap.parse_args(argv)
    extra = [BlockSizes(*(int(x) for x in t.split(","))) for t in args.tiles]
    print(f"# triton {triton.__version__}, sm_{args.arch}a, head dim {args.dim}, bf16, "
          f"loads: {args.loads}")  # fmt: skip
    head = ("kernel", "tiles (m, n, warps, stages)", "regs", "spill st/ld B", "smem B")
    print("{:>6} {:>28} {:>5} {:>14} {:>8}".format(*head))
    for kernel in args.kernels.split(","):
        default = default_block_sizes(args.dim, kernel)
        for tiles in [default, *(t for t in extra if t != default)]:
            tma = None if args.loads == "launch" else args.loads == "tma"
            r = resources(kernel, args.dim, tiles, args.arch, tma, args.silu and kernel != "fwd",
                          args.stored and kernel == "dkdv")  # fmt: skip
            tag = ",".join(str(x) for x in (tiles.block_m, tiles.block_n, tiles.num_warps,
                                            tiles.num_stages))  # fmt: skip
            tag += " (default)" if tiles == default else ""
            print(f"{kernel:>6} {tag:>28} {r['registers']:>5} "
                  f"{r['spill_stores']:>6}/{r['spill_loads']:<7} {r['shared']:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
