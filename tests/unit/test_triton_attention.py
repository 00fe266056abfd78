"""Triton HSTU attention vs the plain-torch reference (kernels/README.md contract).

Without CUDA the kernels run in the Triton CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported) on small shapes; with CUDA they run compiled on larger shapes (``gpu``).
"""

import importlib
import os
import re
import zlib

import numpy as np
import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    # must happen before hstu_kernels.triton decorates its kernels
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hstu_kernels.schedule import pairs, schedule  # noqa: E402
from hstu_kernels.triton import (  # noqa: E402
    BlockSizes,
    hstu_attention,
    hstu_attention_reference,
    hstu_mask_reference,
)
from hstu_kernels.triton.hstu_attention import (  # noqa: E402
    hstu_attention_bwd,
    hstu_attention_fwd,
    is_interpret_mode,
)

# the module (the package attribute of the same name is the function)
hstu_attention_module = importlib.import_module("hstu_kernels.triton.hstu_attention")
_launch = importlib.import_module("hstu_kernels.triton._launch")
_INTERPRET = is_interpret_mode()
if not _CUDA and not _INTERPRET:
    pytest.skip(
        "no CUDA and the Triton kernels were built before TRITON_INTERPRET=1 was set "
        "(hstu_kernels.triton imported earlier in this process); run this file on its own "
        "or export TRITON_INTERPRET=1",
        allow_module_level=True,
    )

MODES = [
    pytest.param(
        "interpret",
        marks=pytest.mark.skipif(
            not _INTERPRET, reason="interpret mode: kernels are compiled for CUDA in this process"
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not _CUDA or _INTERPRET, reason="needs CUDA"),
        ],
    ),
]

# name -> (contextual, candidates, rab_pos, rab_time)
CASES = {
    "plain": (False, False, False, False),
    "ctx": (True, False, False, False),
    "cand": (False, True, False, False),
    "ctx_cand": (True, True, False, False),
    "plain_rab": (False, False, True, True),
    "ctx_rab": (True, False, True, True),
    "cand_rab": (False, True, True, True),
    "ctx_cand_pos": (True, True, True, False),
    "ctx_cand_time": (True, True, False, True),
    "ctx_cand_rab": (True, True, True, True),
}
# (case, dtype, tiles): every case in fp32, the hardest and the plainest in bf16 / fp16, and
# the hardest with block_m != block_n (the block-skipping ranges depend on both)
COMBOS = [(c, torch.float32, "default") for c in CASES] + [
    ("plain", torch.bfloat16, "default"),
    ("ctx_cand_rab", torch.bfloat16, "default"),
    ("ctx_cand_rab", torch.float16, "default"),
    ("ctx_cand_rab", torch.float32, "uneven"),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}

# per mode: sample lengths (with a zero-length and a length-1 sample), contextual / candidate
# counts, max_seqlen, heads, dims, capacity-padding rows, rab sizes, block sizes
SHAPES = {
    "interpret": dict(
        lengths=[13, 0, 1, 40, 7],
        ctx=[3, 0, 1, 5, 0],
        cand=[2, 0, 0, 6, 3],
        max_seqlen=40,
        H=2,
        D=16,
        Dv=24,
        pad=3,
        P=12,
        TB=8,
        blocks={
            "default": BlockSizes(16, 16, 1, 1),
            # forward, dk/dv and dq kernels each with tiles and a launch order of their own
            "uneven": (
                BlockSizes(32, 16, 1, 1, lead=1),
                BlockSizes(16, 32, 1, 1, lead=0),
                BlockSizes(32, 16, 1, 1, lead=2),
            ),
        },
    ),
    "cuda": dict(
        lengths=[300, 0, 1, 1000, 77, 513],
        ctx=[10, 0, 1, 64, 0, 5],
        cand=[20, 0, 0, 100, 7, 0],
        max_seqlen=1100,
        H=4,
        D=64,
        Dv=96,
        pad=17,
        P=256,
        TB=16,
        blocks={
            "default": None,
            "uneven": (  # fp32: FMA dots
                BlockSizes(32, 64, 4, 1, lead=3),
                BlockSizes(64, 32, 4, 1, lead=0),
                BlockSizes(32, 32, 4, 1, lead=5),
            ),
        },
    ),
}


def _device(mode: str) -> torch.device:
    return torch.device("cpu" if mode == "interpret" else "cuda")


def _make_inputs(mode, case, dtype, seed):
    cfg = SHAPES[mode]
    has_ctx, has_cand, has_pos, has_time = CASES[case]
    dev = _device(mode)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(cfg["lengths"])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    T = int(offsets[-1]) + cfg["pad"]
    H, D, Dv = cfg["H"], cfg["D"], cfg["Dv"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    qkv = [rnd(T, H, D), rnd(T, H, D), rnd(T, H, Dv)]
    kw = dict(max_seqlen=cfg["max_seqlen"], alpha=1.0 / D**0.5, normalizer=float(cfg["max_seqlen"]))
    if has_ctx:
        kw["num_contextual"] = torch.tensor(cfg["ctx"], dtype=torch.int32, device=dev)
    if has_cand:
        kw["num_candidates"] = torch.tensor(cfg["cand"], dtype=torch.int64, device=dev)
    tables = {}
    if has_pos:
        tables["rab_pos"] = rnd(H, cfg["P"], scale=0.5)
    if has_time:
        tables["rab_time"] = rnd(H, cfg["TB"], scale=0.5)
        gaps = torch.randint(0, 300, (T,), generator=gen)
        kw["timestamps"] = gaps.cumsum(0).to(dev)  # spans more than TB log2 buckets
    grad_out = rnd(T, H, Dv)
    return qkv, offsets.to(dev), kw, tables, grad_out, int(offsets[-1])


def _assert_close(actual, expected, tol, what):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}"
    )


# `make test` keeps the plainest case, both masks, every bias at once (fp32 and bf16) and the
# uneven tiles; the other combinations (~45 s in the interpreter) run in the slow tier
MAIN_COMBOS = {
    ("plain", torch.float32, "default"),
    ("ctx_cand", torch.float32, "default"),
    ("ctx_cand_rab", torch.float32, "default"),
    ("ctx_cand_rab", torch.bfloat16, "default"),
    ("ctx_cand_rab", torch.float32, "uneven"),
}


@pytest.mark.parametrize(
    ("case", "dtype", "tiles"),
    [
        pytest.param(
            *combo,
            id=f"{combo[0]}-{str(combo[1])[6:]}-{combo[2]}",
            marks=[] if combo in MAIN_COMBOS else [pytest.mark.slow],
        )
        for combo in COMBOS
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_hstu_attention_matches_reference(mode, case, dtype, tiles):
    seed = zlib.crc32(f"{mode}/{case}/{dtype}".encode())
    qkv, offsets, kw, tables, grad_out, total = _make_inputs(mode, case, dtype, seed)
    names = ["q", "k", "v", *tables]

    # kernel: inputs in `dtype`; reference: the same (rounded) values in fp32
    leaves = [x.to(dtype).requires_grad_() for x in qkv] + [
        t.clone().requires_grad_() for t in tables.values()
    ]
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]

    def call(fn, xs, **extra):
        q, k, v, *tabs = xs
        return fn(q, k, v, offsets, **kw, **dict(zip(tables, tabs)), **extra)

    out = call(hstu_attention, leaves, block_sizes=SHAPES[mode]["blocks"][tiles])
    ref = call(hstu_attention_reference, ref_leaves)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOL[dtype]
    _assert_close(out, ref, tol, "out")
    assert torch.all(out[total:] == 0), "capacity-padding rows must be zero"

    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
    for name, g, rg, leaf in zip(names, grads, ref_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        # a bias bucket sums up to ~B * n^2 terms (the clamped last one most): fp32 order noise
        _assert_close(g, rg, max(tol, 1e-4) if name.startswith("rab") else tol, f"d{name}")
        if name in ("q", "k", "v"):
            assert torch.all(g[total:] == 0), f"d{name}: capacity-padding rows must be zero"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backward", ["split", "fused"])
def test_descriptor_and_pointer_loads_give_the_same_attention(
    mode, backward, monkeypatch, spy_launches
):
    """Each kernel reads a sample's rows through tensor descriptors (TMA) where it is enabled
    (`HSTU_TRITON_TMA`) and the inputs allow it, else through pointer tiles: the two give the
    same output and gradients on jagged samples with contextual and candidate tokens, capacity
    padding and a Dv of 24 (the descriptors' column tail reads zeros); split with both biases
    and their tables' gradients, fused with the biases frozen (with table gradients it runs
    split)."""
    case, dtype = "ctx_cand_rab", torch.float32
    qkv, offsets, kw, tables, grad_out, total = _make_inputs(mode, case, dtype, 1234)
    names = ["_hstu_fwd_kernel", "_hstu_bwd_dq_kernel"]
    names.append("_hstu_bwd_fused_kernel" if backward == "fused" else "_hstu_bwd_dkdv_kernel")
    spies = [spy_launches(_launch, name) for name in names]
    train_tables = backward == "split"

    def run():
        leaves = [x.clone().requires_grad_() for x in qkv]
        tabs = [t.clone().requires_grad_(train_tables) for t in tables.values()]
        out = hstu_attention(*leaves, offsets, **kw, **dict(zip(tables, tabs)), backward=backward)
        wrt = leaves + (tabs if train_tables else [])
        return out, torch.autograd.grad(out, wrt, grad_out)

    monkeypatch.setattr(_launch, "_TMA_KERNELS", frozenset(_launch.TILE_KERNELS))
    out_tma, grads_tma = run()
    assert all(spy.meta[-1]["TMA"] for spy in spies if spy.meta)
    assert len([spy for spy in spies if spy.meta]) == (2 if backward == "fused" else 3)
    monkeypatch.setattr(_launch, "_TMA_KERNELS", frozenset())
    out_ptr, grads_ptr = run()
    assert not any(spy.meta[-1]["TMA"] for spy in spies if spy.meta)
    _assert_close(out_tma, out_ptr, 1e-6, "out")
    for name, a, b in zip(["q", "k", "v", *tables], grads_tma, grads_ptr, strict=False):
        _assert_close(a, b, 1e-5 if backward == "fused" else 1e-6, f"d{name}")


def test_tma_setting_names_kernels():
    """`HSTU_TRITON_TMA`: 1 (or unset) the measured set, 0 none, else a list of kernels; a
    name that is not a kernel is refused with the valid ones."""
    assert _launch._tma_kernels("1") == _launch._TMA_DEFAULT == {"fwd", "dq"}
    assert _launch._tma_kernels("") == _launch._TMA_DEFAULT
    assert _launch._tma_kernels("0") == frozenset()
    assert _launch._tma_kernels("fwd, dkdv,dq") == {"fwd", "dkdv", "dq"}
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['bwd'\].*fused"):
        _launch._tma_kernels("fwd,bwd")


def test_package_names_the_function_whichever_module_loads_the_kernels_first():
    """`from hstu_kernels.triton import hstu_attention` is the function also when a sibling
    (`bench`) loaded the submodule of the same name first (it used to be the module)."""
    import subprocess
    import sys

    code = (
        "import hstu_kernels.triton.bench\n"
        "from hstu_kernels.triton import hstu_attention\n"
        "from hstu_kernels.triton import BlockSizes\n"
        "import importlib\n"
        "mod = importlib.import_module('hstu_kernels.triton.hstu_attention')\n"
        "assert callable(hstu_attention) and hstu_attention is mod.hstu_attention\n"
        "assert BlockSizes is mod.BlockSizes\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]


def test_descriptors_only_where_tma_can_address_the_rows(monkeypatch):
    """`use_tma`: 16-byte aligned base pointers and row / head strides and a contiguous last
    dim, else pointer loads (the kernels then run as before)."""
    monkeypatch.setattr(_launch, "_TMA_KERNELS", _launch._TMA_DEFAULT)
    dev = torch.device("cpu" if _INTERPRET else "cuda")
    x = torch.zeros(10, 2, 16, device=dev)
    if not _INTERPRET and torch.cuda.get_device_capability()[0] < 9:
        assert not _launch.use_tma("fwd", x)  # no TMA before Hopper
        return
    assert _launch.use_tma("fwd", x, x)
    assert not _launch.use_tma("fwd", x.view(-1)[1:161].view(10, 1, 16))  # base 4 bytes off
    assert not _launch.use_tma("fwd", torch.zeros(10, 2, 18, device=dev, dtype=torch.bfloat16))
    assert not _launch.use_tma("fwd", torch.zeros(10, 16, 2, device=dev).transpose(1, 2))
    assert not _launch.use_tma("dkdv", x)  # kernels outside the setting keep pointer tiles


# (case, dtype, tiles, table grads): the fused backward on the masks, biases in the logits
# without table grads (fused), with them (split runs), bf16, and block_m != block_n
FUSED_COMBOS = [
    ("ctx_cand", torch.float32, "default", False),
    ("ctx_cand", torch.float32, "uneven", False),
    ("ctx_cand_rab", torch.float32, "default", False),
    ("ctx_cand_rab", torch.bfloat16, "default", False),
    ("ctx_cand_pos", torch.float32, "default", True),
]


@pytest.mark.parametrize(
    ("case", "dtype", "tiles", "table_grads"),
    FUSED_COMBOS,
    ids=[f"{c}-{str(d)[6:]}-{t}{'-table_grads' * g}" for c, d, t, g in FUSED_COMBOS],
)
@pytest.mark.parametrize("mode", MODES)
def test_fused_backward_matches_split_and_reference(
    mode, case, dtype, tiles, table_grads, monkeypatch, spy_launches
):
    """backward="fused" (one key-major kernel, dq added atomically in fp32) gives the split
    backward's and the reference's gradients, zero on capacity-padding rows; with table
    gradients needed it runs the split kernels (they reduce those)."""
    seed = zlib.crc32(f"{mode}/{case}/{dtype}".encode())
    qkv, offsets, kw, tables, grad_out, total = _make_inputs(mode, case, dtype, seed)
    spy = spy_launches(_launch, "_hstu_bwd_fused_kernel")
    blocks = SHAPES[mode]["blocks"][tiles]

    def run(fn, to, **extra):
        leaves = [x.to(dtype).to(to).clone().requires_grad_() for x in qkv]
        tabs = [t.clone().requires_grad_(table_grads) for t in tables.values()]
        out = fn(*leaves, offsets, **kw, **dict(zip(tables, tabs)), **extra)
        wrt = leaves + (tabs if table_grads else [])
        return out, torch.autograd.grad(out, wrt, grad_out.to(to))

    out, split = run(hstu_attention, dtype, block_sizes=blocks, backward="split")
    assert not spy.grids
    if table_grads:
        # the entry picks split where a table requires grad; past it, the backward op asked
        # for "fused" runs split as well (the split dq kernel reduces the table gradients)
        table = tables["rab_pos"].clone().requires_grad_()
        picked = hstu_attention_module._resolve_backward("fused", qkv[0], qkv[2], table, None)
        assert picked == "split"
        monkeypatch.setattr(hstu_attention_module, "_resolve_backward", lambda b, *_: b)
    fused_out, fused = run(hstu_attention, dtype, block_sizes=blocks, backward="fused")
    # one launch per time path (a time table: float64 and integer buckets, _launch._time_paths)
    launches = len(_launch._time_paths(tables.get("rab_time")))
    assert len(spy.grids) == (0 if table_grads else launches)
    _, ref = run(hstu_attention_reference, torch.float32)
    assert torch.equal(fused_out, out)
    tol = TOL[dtype]
    names = ["q", "k", "v", *(tables if table_grads else ())]
    for name, g, sg, rg in zip(names, fused, split, ref, strict=True):
        assert g.dtype == sg.dtype and g.shape == sg.shape, name
        _assert_close(g, sg, tol, f"d{name} fused vs split")
        _assert_close(g, rg, max(tol, 1e-4) if name.startswith("rab") else tol, f"d{name}")
        if name in ("q", "k", "v"):
            assert torch.all(g[total:] == 0), f"d{name}: capacity-padding rows must be zero"


# (case, dtype, tiles, table grads, loads): "stored" on the masks with the dk/dv and dq tiles
# of different shapes (the dq kernel then meets pairs the dk/dv kernel never stored), biases
# in the logits, bf16, descriptor and pointer loads, and with table grads (split runs)
STORED_COMBOS = [
    ("ctx_cand", torch.float32, "uneven", False, "tma"),
    ("ctx_cand", torch.float32, "uneven", False, "pointers"),
    ("ctx_cand_rab", torch.float32, "default", False, "tma"),
    ("ctx_cand", torch.bfloat16, "default", False, "tma"),
    ("ctx_cand_pos", torch.float32, "default", True, "tma"),
]


@pytest.mark.parametrize(
    ("case", "dtype", "tiles", "table_grads", "loads"),
    [
        pytest.param(
            *combo,
            id=f"{c}-{str(d)[6:]}-{t}{'-table_grads' * g}-{x}",
            # in `make test`: the uneven tiles, bf16 and the fallback; the biased logits and
            # the pointer loads (~3-4 s each interpreted) in the slow tier
            marks=[pytest.mark.slow] if c == "ctx_cand_rab" or x == "pointers" else [],
        )
        for combo in STORED_COMBOS
        for c, d, t, g, x in [combo]
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_stored_backward_matches_split_and_reference(
    mode, case, dtype, tiles, table_grads, loads, monkeypatch, spy_launches
):
    """backward="stored" (the dk/dv kernel stores dS, dq is one matmul a tile pair from it)
    gives the split backward's and the reference's gradients, zero on capacity-padding rows,
    with its buffer filled with NaN first (the dq kernel reads only what was stored and masks
    the rest); with table gradients needed it runs the split kernels."""
    seed = zlib.crc32(f"stored/{mode}/{case}/{dtype}".encode())
    qkv, offsets, kw, tables, grad_out, total = _make_inputs(mode, case, dtype, seed)
    spy = spy_launches(_launch, "_hstu_bwd_dq_stored_kernel")
    split_dq = spy_launches(_launch, "_hstu_bwd_dq_kernel")
    blocks = SHAPES[mode]["blocks"][tiles]
    monkeypatch.setattr(
        _launch, "_TMA_KERNELS", frozenset(_launch.TILE_KERNELS if loads == "tma" else ())
    )
    buffers = []

    def nan_buffer(H, T, max_seqlen, like):
        buffers.append(torch.full((H, T, _launch._ds_width(max_seqlen)), float("nan"),
                                  dtype=like.dtype, device=like.device))  # fmt: skip
        return buffers[-1]

    monkeypatch.setattr(_launch, "_ds_buffer", nan_buffer)

    def run(fn, to, **extra):
        leaves = [x.to(dtype).to(to).clone().requires_grad_() for x in qkv]
        tabs = [t.clone().requires_grad_(table_grads) for t in tables.values()]
        out = fn(*leaves, offsets, **kw, **dict(zip(tables, tabs)), **extra)
        wrt = leaves + (tabs if table_grads else [])
        return out, torch.autograd.grad(out, wrt, grad_out.to(to))

    out, split = run(hstu_attention, dtype, block_sizes=blocks, backward="split")
    paths = len(_launch._time_paths(tables.get("rab_time")))  # split's dq: one per time path
    assert not spy.grids and len(split_dq.grids) == paths
    if table_grads:
        table = tables["rab_pos"].clone().requires_grad_()
        picked = hstu_attention_module._resolve_backward("stored", qkv[0], qkv[2], table, None)
        assert picked == "split"
        monkeypatch.setattr(hstu_attention_module, "_resolve_backward", lambda b, *_: b)
    stored_out, stored = run(hstu_attention, dtype, block_sizes=blocks, backward="stored")
    assert len(spy.grids) == (0 if table_grads else 1)
    assert len(split_dq.grids) == (2 if table_grads else 1) * paths
    if not table_grads:
        T, H = qkv[0].shape[:2]
        assert [tuple(b.shape) for b in buffers] == [(H, T, _launch._ds_width(kw["max_seqlen"]))]
        assert bool(torch.isfinite(buffers[0]).any())  # the dk/dv kernel stored into it
        assert spy.meta[-1]["TMA"] == (loads == "tma")
    _, ref = run(hstu_attention_reference, torch.float32)
    assert torch.equal(stored_out, out)
    tol = TOL[dtype]
    names = ["q", "k", "v", *(tables if table_grads else ())]
    for name, g, sg, rg in zip(names, stored, split, ref, strict=True):
        assert g.dtype == sg.dtype and g.shape == sg.shape, name
        assert bool(torch.isfinite(g).all()), f"d{name}: a NaN of the buffer leaked"
        if name in ("k", "v") or dtype == torch.float32:
            # dk / dv: the same kernel's; fp32 dq: the same dS, summed in another order
            _assert_close(g, sg, 1e-6 if name in ("k", "v") else tol, f"d{name} stored vs split")
        _assert_close(g, rg, max(tol, 1e-4) if name.startswith("rab") else tol, f"d{name}")
        if name in ("q", "k", "v"):
            assert torch.all(g[total:] == 0), f"d{name}: capacity-padding rows must be zero"


def test_stored_backward_bounds_its_buffer(monkeypatch, spy_launches):
    """ "stored" sizes its dS buffer from the rows, heads and max_seqlen (``stored_ds_bytes``)
    and runs split where it would pass ``STORED_DS_MAX_BYTES``."""
    assert _launch.stored_ds_bytes(12288, 4, 4100) == 4 * 12288 * 4160 * 2
    assert _launch.stored_ds_bytes(10, 2, 1, torch.float32) == 2 * 10 * 64 * 4
    mode = "interpret" if _INTERPRET else "cuda"
    qkv, offsets, kw, _, grad_out, _ = _make_inputs(mode, "ctx_cand", torch.float32, 7)
    spy = spy_launches(_launch, "_hstu_bwd_dq_stored_kernel")
    split_dq = spy_launches(_launch, "_hstu_bwd_dq_kernel")
    T, H = qkv[0].shape[:2]
    need = _launch.stored_ds_bytes(T, H, kw["max_seqlen"], torch.float32)
    for cap, stored in ((need, True), (need - 1, False)):
        monkeypatch.setattr(_launch, "STORED_DS_MAX_BYTES", cap)
        leaves = [x.clone().requires_grad_() for x in qkv]
        out = hstu_attention(*leaves, offsets, **kw, backward="stored")
        torch.autograd.grad(out, leaves, grad_out)
        assert (len(spy.grids), len(split_dq.grids)) == ((1, 0) if stored else (1, 1))


# (case, dtype, backward, table grads); the bf16 biased case (~12 s in the interpreter) runs
# in the slow tier: the fp32 one covers the biases, the bf16 fused one the low precision
UVQK_COMBOS = [
    ("ctx_cand", torch.float32, "split", False),
    ("ctx_cand_rab", torch.float32, "split", True),
    ("ctx_cand_rab", torch.bfloat16, "split", False),
    ("ctx_cand", torch.bfloat16, "fused", False),
    ("ctx_cand", torch.bfloat16, "stored", False),
]


@pytest.mark.parametrize(
    ("case", "dtype", "backward", "table_grads"),
    [
        pytest.param(
            *combo,
            id=f"{combo[0]}-{str(combo[1])[6:]}-{combo[2]}{'-table_grads' * combo[3]}",
            # in `make test`: fp32 with the biases and their tables' gradients, bf16 fused
            marks=[pytest.mark.slow]
            if combo[:3] != ("ctx_cand_rab", torch.float32, "split") and combo[2] != "fused"
            else [],
        )
        for combo in UVQK_COMBOS
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_uvqk_attention_equals_split_then_attention(mode, case, dtype, backward, table_grads):
    """`hstu_uvqk_attention` on one [T, H (2 dv + 2 dqk)] activation: u is a view of its
    columns, the output and every gradient equal splitting it and calling `hstu_attention`
    (the same kernels; the gradient is built in one buffer instead of a concatenation), and
    the gradient's q / k / v columns are zero on capacity-padding rows."""
    from hstu_kernels.triton import hstu_uvqk_attention

    seed = zlib.crc32(f"uvqk/{mode}/{case}/{dtype}".encode())
    (q, k, v), offsets, kw, tables, grad_out, total = _make_inputs(mode, case, dtype, seed)
    T, H, dqk = q.shape
    dv = v.shape[2]
    gen = torch.Generator().manual_seed(seed)
    uvqk0 = torch.cat([torch.randn(T, H * dv, generator=gen).to(q.device), v.flatten(1),
                       q.flatten(1), k.flatten(1)], dim=1).to(dtype)  # fmt: skip
    grad_u = torch.randn(T, H * dv, generator=gen).to(q.device, dtype)
    dims = dict(num_heads=H, linear_dim=dv, attention_dim=dqk)
    blocks = SHAPES[mode]["blocks"]["default"]

    def run(fused_entry):
        uvqk = uvqk0.clone().requires_grad_()
        tabs = {n: t.clone().requires_grad_(table_grads) for n, t in tables.items()}
        common = dict(**kw, **tabs, block_sizes=blocks, backward=backward)
        if fused_entry:
            u, out = hstu_uvqk_attention(uvqk, offsets, **dims, **common)
            assert u.data_ptr() == uvqk.data_ptr() and u.shape == (T, H * dv)
        else:
            u, vv, qq, kk = torch.split(uvqk, [H * dv, H * dv, H * dqk, H * dqk], dim=1)
            un = (H, -1)
            out = hstu_attention(qq.unflatten(1, un), kk.unflatten(1, un), vv.unflatten(1, un),
                                 offsets, **common)  # fmt: skip
        wrt = [uvqk, *(tabs.values() if table_grads else ())]
        grads = torch.autograd.grad((u, out), wrt, (grad_u, grad_out.to(dtype)))
        return u, out, grads

    u, out, grads = run(True)
    ref_u, ref_out, ref_grads = run(False)
    assert torch.equal(u, ref_u) and torch.equal(out, ref_out)
    # on a GPU the fused dq and the bias tables' gradients sum by atomics, in varying order
    for i, (g, rg) in enumerate(zip(grads, ref_grads, strict=True)):
        if mode == "interpret" or (i == 0 and backward == "split"):
            assert torch.equal(g, rg)
        else:
            _assert_close(g, rg, max(TOL[dtype], 1e-4), f"gradient {i}")
    assert torch.equal(grads[0][:, : H * dv], grad_u)
    assert torch.all(grads[0][total:, H * dv :] == 0), "padding rows of dv / dq / dk"

    # only the output used: the gradient's u columns are zero; only u used: all but u zero
    uvqk = uvqk0.clone().requires_grad_()
    again = dict(**dims, **kw, **tables, block_sizes=blocks, backward="split")
    (g,) = torch.autograd.grad(
        hstu_uvqk_attention(uvqk, offsets, **again)[1], uvqk, grad_out.to(dtype)
    )
    if backward == "split":
        assert torch.equal(g[:, H * dv :], ref_grads[0][:, H * dv :])
    assert torch.all(g[:, : H * dv] == 0) and torch.any(g[:, H * dv :] != 0)
    (g,) = torch.autograd.grad(hstu_uvqk_attention(uvqk, offsets, **again)[0], uvqk, grad_u)
    assert torch.equal(g[:, : H * dv], grad_u) and torch.all(g[:, H * dv :] == 0)


# bf16 in the slow tier (~6 s interpreted on 2 cores); fp32, the tighter check, in `make test`
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("mode", MODES)
def test_uvqk_attention_with_the_gated_norm_equals_the_op_then_the_norm(mode, dtype):
    """`hstu_uvqk_attention(norm=...)`: the attention and the layer's gated norm in one op,
    whose backward writes u's gradient into the activation's gradient in place, give the
    values and gradients of the op followed by `layer_norm(out, gate=u)` (the same kernels)."""
    from hstu_kernels.triton import hstu_uvqk_attention
    from hstu_kernels.triton.layer_norm import layer_norm

    seed = zlib.crc32(f"uvqk-norm/{mode}/{dtype}".encode())
    (q, k, v), offsets, kw, tables, grad_out, total = _make_inputs(
        mode, "ctx_cand_rab", dtype, seed
    )
    T, H, dqk = q.shape
    dv = v.shape[2]
    gen = torch.Generator().manual_seed(seed)
    uvqk0 = torch.cat([torch.randn(T, H * dv, generator=gen).to(q.device), v.flatten(1),
                       q.flatten(1), k.flatten(1)], dim=1).to(dtype)  # fmt: skip
    w0 = (torch.randn(H * dv, generator=gen) * 0.3 + 1).to(q.device)
    b0 = (torch.randn(H * dv, generator=gen) * 0.1).to(q.device)
    dy = torch.randn(T, H * dv, generator=gen).to(q.device, dtype)
    dy[total:] = 0.0  # capacity padding: no upstream gradient
    dims = dict(num_heads=H, linear_dim=dv, attention_dim=dqk)
    common = dict(**dims, **kw, **tables, block_sizes=SHAPES[mode]["blocks"]["default"],
                  backward="split")  # fmt: skip

    def run(in_op):
        uvqk, w, b = (t.clone().requires_grad_() for t in (uvqk0, w0, b0))
        if in_op:
            y = hstu_uvqk_attention(uvqk, offsets, **common, norm=(w, b, 1e-6))
        else:
            u, out = hstu_uvqk_attention(uvqk, offsets, **common)
            y = layer_norm(out.reshape(T, H * dv), w, b, 1e-6, gate=u)
        return (y, *torch.autograd.grad(y, (uvqk, w, b), dy))

    got, want = run(True), run(False)
    for name, g, e in zip(["y", "duvqk", "dweight", "dbias"], got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if mode == "interpret":  # the same kernels on the same inputs
            assert torch.equal(g, e), name
        else:  # on a GPU the dq / table atomics sum in a varying order
            _assert_close(g, e, max(TOL[dtype], 1e-4), name)
    assert got[2].dtype == torch.float32 and torch.any(got[1][:, : H * dv] != 0)
    with pytest.raises(ValueError, match=rf"norm weight must be a \[{H * dv}\] tensor"):
        hstu_uvqk_attention(uvqk0, offsets, **common, norm=(w0[:-1], b0, 1e-6))
    with pytest.raises(ValueError, match="norm eps must be a positive number"):
        hstu_uvqk_attention(uvqk0, offsets, **common, norm=(w0, b0, 0.0))
    with pytest.raises(ValueError, match=r"norm must be \(weight, bias, eps\)"):
        hstu_uvqk_attention(uvqk0, offsets, **common, norm=(w0, b0))


# the slow tier (~4 / 8 s interpreted on 2 cores): `model.silu_epilogues` is off by default
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_linear_uvqk_attention_equals_linear_silu_then_the_op(mode, dtype, spy_launches):
    """`hstu_linear_uvqk_attention`: the uvqk projection, its SiLU, the attention and the
    gated norm in one op, whose backward runs SiLU's backward in the kernels that write the
    gradients (the gated norm's, the dk / dv and dq kernels' epilogues) and sums the bias
    gradient there, gives the values and gradients of `linear_silu` then
    `hstu_uvqk_attention(norm=...)` (which write SiLU's input gradient, rounded, then run
    SiLU's backward on it: equal up to that rounding), the tables' gradients too; with the
    fused backward it is that composition."""
    from hstu_kernels.triton import hstu_linear_uvqk_attention, hstu_uvqk_attention
    from hstu_kernels.triton.linear_silu import linear_silu

    seed = zlib.crc32(f"linear-uvqk/{mode}/{dtype}".encode())
    (q, k, v), offsets, kw, tables, grad_out, total = _make_inputs(
        mode, "ctx_cand_rab", dtype, seed
    )
    T, H, dqk = q.shape
    dv = v.shape[2]
    d_in, width = 20, H * (2 * dv + 2 * dqk)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(q.device)

    x0 = rnd(T, d_in).to(dtype)
    x0[total:] = 0.0  # capacity padding, as a normed stream's padding rows
    w0, b0 = rnd(d_in, width, scale=0.3), rnd(width, scale=0.5)
    nw0, nb0 = rnd(H * dv, scale=0.3, shift=1.0), rnd(H * dv, scale=0.1)
    dy = rnd(T, H * dv).to(dtype)
    dy[total:] = 0.0  # no upstream gradient on padding rows
    blocks = SHAPES[mode]["blocks"]["default"]
    dims = dict(num_heads=H, linear_dim=dv, attention_dim=dqk)

    def run(fused, backward="split", train_tables=True):
        x, w, b, nw, nb = (t.clone().requires_grad_() for t in (x0, w0, b0, nw0, nb0))
        tabs = {n: t.clone().requires_grad_(train_tables) for n, t in tables.items()}
        common = dict(**dims, **kw, **tabs, block_sizes=blocks, backward=backward)
        if fused:
            y = hstu_linear_uvqk_attention(x, w, b, offsets, **common, norm=(nw, nb, 1e-6))
        else:
            y = hstu_uvqk_attention(linear_silu(x, w, b), offsets, **common, norm=(nw, nb, 1e-6))
        wrt = (x, w, b, nw, nb, *(tabs.values() if train_tables else ()))
        return (y, *torch.autograd.grad(y, wrt, dy))

    got, want = run(True), run(False)
    names = ["y", "dx", "dweight", "dbias", "dnorm_weight", "dnorm_bias", *tables]
    assert len(got) == len(names) == len(want)
    # fp32: each value within fp32 rounding; bf16: the composition rounds SiLU's input
    # gradient to bf16 before its backward, the op does not
    tol = max(TOL[dtype], 1e-4)
    for name, g, e in zip(names, got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if name == "y":
            assert torch.equal(g, e), name  # the forward is the composition's
        else:
            _assert_close(g, e, tol, name)
    assert got[3].dtype == torch.float32 and torch.all(got[3] != 0), "every bias column"
    assert torch.all(got[1][total:] == 0), "padding rows get no input gradient"

    # the fused backward (dq atomics) runs the composition
    fused_bwd = run(True, "fused")
    for name, g, e in zip(names, fused_bwd, run(False, "fused"), strict=True):
        _assert_close(g, e, tol, f"{name}, fused backward")
    # the stored backward (tables frozen: with their gradients it runs split) with SiLU's
    # backward in the dk / dv and the stored dq kernels' epilogues
    spy = spy_launches(_launch, "_hstu_bwd_dq_stored_kernel")
    stored = run(True, "stored", train_tables=False)
    assert len(spy.grids) == 1 and spy.meta[-1]["SILU"]
    want = run(False, "stored", train_tables=False)
    for name, g, e in zip(names[: len(want)], stored, want, strict=True):
        _assert_close(g, e, tol, f"{name}, stored backward")
    with pytest.raises(ValueError, match=rf"weight must be \[in, {width}\]"):
        hstu_linear_uvqk_attention(x0, w0[:, 1:], b0[1:], offsets, **dims, **kw,
                                   norm=(nw0, nb0, 1e-6))  # fmt: skip
    with pytest.raises(ValueError, match="reduced copies of shapes"):
        hstu_linear_uvqk_attention(x0, w0, b0, offsets, **dims, **kw, norm=(nw0, nb0, 1e-6),
                                   reduced=(w0[:1], b0))  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_uvqk_attention_validation(mode):
    from hstu_kernels.triton import hstu_uvqk_attention

    dev = _device(mode)
    offsets = torch.tensor([0, 5], device=dev)
    kw = dict(max_seqlen=5, alpha=1.0, normalizer=5.0)
    x = torch.zeros(5, 2 * (2 * 8 + 2 * 4), device=dev)
    with pytest.raises(ValueError, match=r"uvqk must be \[T, 48\]"):
        hstu_uvqk_attention(x[:, :40], offsets, num_heads=2, linear_dim=8, attention_dim=4, **kw)
    with pytest.raises(ValueError, match="contiguous last dim"):
        hstu_uvqk_attention(torch.zeros(48, 5, device=dev).t(), offsets, num_heads=2,
                            linear_dim=8, attention_dim=4, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="num_heads must be a positive python int"):
        hstu_uvqk_attention(x, offsets, num_heads=0, linear_dim=8, attention_dim=4, **kw)
    with pytest.raises(ValueError, match="out: expected shape"):
        _launch._bwd_impl(*(torch.zeros(5, 2, 4, device=dev) for _ in range(4)), offsets, 5,
                          1.0, 5.0, None, None, None, None, None, False, False,
                          (BlockSizes(16, 16, 1, 1),) * 2,
                          out=[torch.zeros(5, 2, 8, device=dev)] * 3)  # fmt: skip


# (POS_GRAD, TIME_GRAD) of the dq kernel (``_launch._table_grad_modes``): time 0 = no time table
# pos mode 1 is for tables without a clamped bucket ("all"), as the launch picks it
TABLE_GRAD_MODES = [
    (buckets, modes)
    for modes in [(3, 0), (2, 0), (1, 1), (2, 1), (2, 2), (1, 2), (3, 2), (3, 1)]
    for buckets in ("few", "all")
    if modes[0] != 1 or buckets == "all"
]


# every position mode (1-3), time mode (0-2) and bucket kind at least once in `make test`; the
# rest of the cross product (~6 s each in the interpreter) with the slow tier
TABLE_GRAD_DEFAULT = {("all", (1, 1)), ("few", (2, 2)), ("all", (3, 0)), ("few", (3, 1))}


@pytest.mark.parametrize(
    ("pos_buckets", "modes"),
    [
        pytest.param(b, m, marks=() if (b, m) in TABLE_GRAD_DEFAULT else pytest.mark.slow)
        for b, m in TABLE_GRAD_MODES
    ],
    ids=[f"{b}-pos{p}-time{t}" for b, (p, t) in TABLE_GRAD_MODES],
)
@pytest.mark.parametrize("mode", MODES)
def test_rab_pos_grad_with_and_without_clamped_bucket(mode, pos_buckets, modes, monkeypatch):
    """Bias-table gradients on every path of the dq kernel, forced: rab_pos by diagonal sums
    per tile (3) or one atomic per pair (1: no clamped bucket; 2: the clamped last bucket
    summed per tile), with one bucket per distance or a clamped last bucket (shared by several
    diagonals; tiles wholly in it summed once), beside rab_time by a row-sum accumulator (2)
    or per-bucket sums (1)."""
    cfg = SHAPES[mode]
    num = 3 if pos_buckets == "few" else cfg["max_seqlen"]
    monkeypatch.setitem(cfg, "P", num)
    monkeypatch.setattr(_launch, "_table_grad_modes", lambda *_: modes)
    case = "ctx_cand_rab" if modes[1] else "ctx_cand_pos"
    qkv, offsets, kw, tables, grad_out, _ = _make_inputs(mode, case, torch.float32, 7)
    names = list(tables)
    leaves = [x.clone().requires_grad_() for x in [*qkv, *tables.values()]]
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    blocks = cfg["blocks"]["default"]
    out = hstu_attention(*leaves[:3], offsets, **kw, **dict(zip(names, leaves[3:], strict=True)),
                         block_sizes=blocks)  # fmt: skip
    ref = hstu_attention_reference(
        *ref_leaves[:3], offsets, **kw, **dict(zip(names, ref_leaves[3:], strict=True))
    )
    grads = torch.autograd.grad(out, leaves[3:], grad_out)
    ref_grads = torch.autograd.grad(ref, ref_leaves[3:], grad_out)
    for name, g, rg in zip(names, grads, ref_grads, strict=True):
        _assert_close(g, rg, 1e-4, f"d{name}")
    rg = ref_grads[0]
    far = min(num, max(cfg["lengths"])) - 1  # the clamped bucket, or the longest distance
    assert rg[:, far].abs().min() > 0, f"bucket {far} must collect pairs in this case"


def test_table_grad_modes_per_head_dim():
    """The measured choice (docs/BENCHMARKS.md): the diagonal sums with no time gradient, the
    time accumulator unless it sits beside the position gradient at head dim > 64."""

    def modes(pos, time, dim, num_pos=4096):
        return _launch._table_grad_modes(pos, time, dim, num_pos, 4096)

    assert modes(True, False, 128) == (3, 0) and modes(True, False, 32, 128) == (3, 0)
    assert modes(True, True, 128) == (1, 1) and modes(True, True, 128, 128) == (2, 1)
    assert modes(True, True, 32) == (1, 2) and modes(True, True, 32, 128) == (2, 2)
    assert modes(False, True, 128) == (0, 2) and modes(False, False, 64) == (0, 0)
    tiles = BlockSizes(64, 32, 4, 3)
    assert _launch._block_tb(16, 2, tiles) == 32 and _launch._block_tb(16, 1, tiles) == 16
    assert _launch._block_tb(40, 2, tiles) == 64 and _launch._block_tb(3, 1, tiles) == 16


# timestamps of the exactness test: as listed (float64 buckets), shifted near the int64 top
# (float64 relative to the smallest), or with two far outliers (the launch spans 2^53 or more:
# the int64 buckets)
TIME_SPANS = {"float64": (0, []), "shifted": (2**62, []), "int64": (0, [2**60 + 3, -(2**61)])}


@pytest.mark.parametrize("span", list(TIME_SPANS))
@pytest.mark.parametrize("num_buckets", [31, 40], ids=["int32_buckets", "int64_buckets"])
@pytest.mark.parametrize("mode", MODES)
def test_time_buckets_exact_near_powers_of_two(mode, num_buckets, span):
    """rab_time buckets are floor(log2(1 + |dt|)) exactly, also where fp32 would round, on
    both of the kernels' paths (float64 relative timestamps; int64 when they span 2^53)."""
    dev = _device(mode)
    ts = [0, 1, 2, 3, 6, 7, 2**20 - 2, 2**20 - 1, 2**24, 2**25 - 2, 2**25 - 1]
    ts += [2**30 - 2, 2**30 - 1, 2**31 - 1, 2**36 - 2, 2**36 - 1, 2**38, 2**40 + 5]
    ts += [2**52 - 1, 2**52 + 7]
    shift, outliers = TIME_SPANS[span]
    ts = [t + shift for t in ts] + outliers
    n = len(ts)
    timestamps = torch.tensor(ts, dtype=torch.int64, device=dev)
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.zeros(n, 1, 16, device=dev) for _ in range(2))  # z = bias only
    v = torch.eye(n, 32)[:, None, :].to(dev)  # out[i, 0, j] = silu(bias(i, j)) * mask / N
    rab_time = torch.randn(1, num_buckets, generator=gen).to(dev).requires_grad_()
    kw = dict(max_seqlen=n, alpha=1.0, normalizer=1.0, timestamps=timestamps, rab_time=rab_time)
    kw["num_contextual"] = torch.tensor([n], device=dev)  # every pair visible
    offsets = torch.tensor([0, n], device=dev)
    out = hstu_attention(q, k, v, offsets, **kw, block_sizes=SHAPES[mode]["blocks"]["default"])
    ref = hstu_attention_reference(q, k, v, offsets, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(out.sum(), rab_time)
    (rg,) = torch.autograd.grad(ref.sum(), rab_time)
    torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)


def _brute_force_mask(n, C, K):
    """The README's prose, case by case."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if i == j:
                mask[i, j] = True  # everyone sees itself
            elif j >= n - K:
                mask[i, j] = False  # candidate keys are seen by themselves only
            elif i < C:
                mask[i, j] = True  # contextual queries see every contextual + history key
            elif j < C:
                mask[i, j] = True  # every query sees the contextual keys
            elif i >= n - K:
                mask[i, j] = True  # candidates see contextual + history keys
            else:
                mask[i, j] = j <= i  # history: causal
    return mask


@pytest.mark.parametrize("n", [0, 1, 2, 5, 9])
def test_mask_reference_matches_brute_force(n):
    for C in range(n + 1):
        for K in range(n - C + 1):
            expect = _brute_force_mask(n, C, K)
            assert torch.equal(hstu_mask_reference(n, C, K), expect), (n, C, K)


@pytest.mark.parametrize("mode", MODES)
def test_hstu_attention_validation(mode):
    dev = _device(mode)
    q = torch.randn(6, 2, 16, device=dev)
    offs = torch.tensor([0, 2, 6], device=dev)
    kw = dict(max_seqlen=4, alpha=1.0, normalizer=4.0)
    with pytest.raises(ValueError, match="k"):
        hstu_attention(q, q[:, :1], q, offs, **kw)
    with pytest.raises(ValueError, match="v"):
        hstu_attention(q, q, q.half(), offs, **kw)
    with pytest.raises(ValueError, match="seq_offsets"):
        hstu_attention(q, q, q, offs.float(), **kw)
    with pytest.raises(ValueError, match="num_candidates"):
        hstu_attention(q, q, q, offs, num_candidates=torch.zeros(3, dtype=torch.int64), **kw)
    with pytest.raises(ValueError, match="timestamps"):
        hstu_attention(q, q, q, offs, rab_time=torch.zeros(2, 4, device=dev), **kw)
    with pytest.raises(ValueError, match="rab_pos"):
        hstu_attention(q, q, q, offs, rab_pos=torch.zeros(3, 4, device=dev), **kw)
    with pytest.raises(ValueError, match="max_seqlen"):
        hstu_attention(q, q, q, offs, max_seqlen=-1, alpha=1.0, normalizer=4.0)
    if dev.type == "cuda":
        with pytest.raises(ValueError, match="k"):
            hstu_attention(q, q.cpu(), q, offs, **kw)
    with pytest.raises(ValueError, match="block_sizes"):
        hstu_attention(q, q, q, offs, **kw, block_sizes=(BlockSizes(),) * 4)
    for bad in ("Fused", "", 1):
        with pytest.raises(
            ValueError,
            match=re.escape(f"backward must be None or one of {_launch.BACKWARDS}, got {bad!r}"),
        ):
            hstu_attention(q, q, q, offs, **kw, backward=bad)


def test_default_tiles_per_head_dim_and_kernel():
    """Every head dim up to 256 maps to a tuned row; each kernel (the fused backward's too)
    has its own tiles there. The backward stays "split" until "fused" is timed on a GPU."""
    tuned = _launch._TUNED
    if _INTERPRET:
        assert _launch.default_block_sizes(256, "dkdv") == _launch.INTERPRET_BLOCK_SIZES
        assert _launch.default_block_sizes(256, "fused") == _launch.INTERPRET_BLOCK_SIZES
    else:
        for dim, row in ((8, 64), (64, 64), (96, 128), (128, 128), (200, 256), (256, 256)):
            for kernel in _launch.TILE_KERNELS:
                assert _launch.default_block_sizes(dim, kernel) == tuned[row][kernel]
        assert _launch.default_block_sizes(512, "fwd").block_m <= 32
        # the dq kernel's tiles where it reduces bias-table gradients (head dims <= 128)
        for dim, row in ((32, 64), (64, 64), (96, 128), (128, 128)):
            grads = _launch.default_block_sizes(dim, "dq", table_grads=True)
            assert grads == _launch._TUNED_DQ_TABLE_GRADS[row] != tuned[row]["dq"]
        assert _launch.default_block_sizes(256, "dq", table_grads=True) == tuned[256]["dq"]
    for row in tuned.values():
        assert set(row) == set(_launch.TILE_KERNELS)
    assert tuned[256]["dkdv"] != tuned[256]["dq"]  # D=256: the dk/dv kernel's own tile
    with pytest.raises(ValueError, match="kernel"):
        _launch.default_block_sizes(128, "bwd")
    # "stored" where the split dq kernel is register-bound (16-bit, head dims 129..256, on a
    # GPU); split elsewhere: the interpreter, fp32, the narrower heads, the untuned wider ones
    for dim in (16, 64, 128, 200, 256, 512):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            stored = not _INTERPRET and dtype != torch.float32 and 128 < dim <= 256
            assert _launch.default_backward(dim, dtype) == ("stored" if stored else "split")


# the fused backward's capture in the slow tier (~4 s interpreted on 2 cores), split's in
# `make test`: the op's registration is the same
@pytest.mark.parametrize("backward", ["split", pytest.param("fused", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", MODES)
def test_custom_op_registration_and_graph_capture(mode, backward, monkeypatch, spy_launches):
    """The ops' schemas, fake kernels and autograd (opcheck), torch.compile with fullgraph and
    eager through the op agree with the eager fast path, in either backward mode (fused: the
    bias table takes no gradient, else split would run)."""
    dev = _device(mode)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(20, 2, 16, generator=gen).to(dev) for _ in range(3))
    offs = torch.tensor([0, 7, 18], device=dev)
    rab_pos = torch.randn(2, 8, generator=gen).to(dev)
    tile = BlockSizes(16, 16, 1, 1) if mode == "interpret" else BlockSizes(64, 64, 4, 2)
    blocks = hstu_attention_module._pack_blocks((tile, tile, tile))
    args = (q, k, v, offs, 16, 0.5, 16.0, None, None, None, rab_pos, None, blocks, backward)
    torch.library.opcheck(hstu_attention_fwd, args)
    if backward == "fused":
        bwd_args = (torch.randn_like(v), *args[:12], False, False, blocks, backward)
        torch.library.opcheck(hstu_attention_bwd, bwd_args)
    spy = spy_launches(_launch, "_hstu_bwd_fused_kernel")

    table_grad = backward == "split"
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    leaves.append(rab_pos.clone().requires_grad_(table_grad))
    bs = SHAPES[mode]["blocks"]["default"]

    def f(q, k, v, rab_pos):
        out = hstu_attention(
            q, k, v, offs, max_seqlen=16, alpha=0.5, normalizer=16.0, rab_pos=rab_pos,
            block_sizes=bs, backward=backward,
        )  # fmt: skip
        return (out.float() ** 2).sum()

    def grads(fn, xs):
        loss = fn(*xs)
        return loss, torch.autograd.grad(loss, [x for x in xs if x.requires_grad])

    def fresh():
        return [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]

    backend = "aot_eager" if mode == "interpret" else "inductor"
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    loss, compiled_grads = grads(compiled, fresh())
    launches = len(spy.grids)
    ref, ref_grads = grads(f, fresh())  # eager: the autograd.Function fast path
    assert len(ref_grads) == (4 if table_grad else 3)
    torch.testing.assert_close(loss, ref)
    for g, rg in zip(compiled_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg)
    # eager through the torch.library op (register_autograd) gives the same
    monkeypatch.setattr(hstu_attention_module, "EAGER_FAST_PATH", False)
    op_out, op_grads = grads(f, fresh())
    torch.testing.assert_close(op_out, ref)
    for g, rg in zip(op_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg)
    # one fused launch per backward (compiled, eager, op), none for split
    assert (launches, len(spy.grids)) == ((1, 3) if backward == "fused" else (0, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA or _INTERPRET, reason="needs CUDA")
def test_fused_backward_replays_in_a_cuda_graph(spy_launches):
    """The fused backward (fp32 buffer, atomics, scale and cast after) syncs nothing with the
    host: forward + backward captured in a CUDA graph replay to the eager gradients."""
    dtype = torch.bfloat16
    qkv, offsets, kw, tables, grad_out, total = _make_inputs("cuda", "ctx_cand_rab", dtype, 11)
    leaves = [x.to(dtype).requires_grad_() for x in qkv]

    def step():
        out = hstu_attention(*leaves, offsets, **kw, **tables, backward="fused")
        return torch.autograd.grad(out, leaves, grad_out.to(dtype))

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    spy = spy_launches(_launch, "_hstu_bwd_fused_kernel")
    with torch.cuda.graph(graph):
        captured = step()
    # one launch per time path (float64 and integer buckets: _launch._time_paths)
    assert len(spy.grids) == len(_launch._time_paths(tables.get("rab_time"))) == 2
    for x in captured:
        x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for name, g, eg in zip("qkv", captured, eager, strict=True):
        _assert_close(g, eg, TOL[dtype], f"d{name} replayed")
        assert torch.all(g[total:] == 0), f"d{name}: capacity-padding rows must be zero"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key_major", [False, True], ids=["query_major", "key_major"])
def test_kernel_schedule_matches_the_reference(mode, key_major):
    """The schedule table the launch fills on the device (here also in the interpreter, where
    the launches use the numpy reference itself) equals kernels/schedule.py, with empty
    samples, capacity padding and the grid's idle tail."""
    dev = _device(mode)
    rng = np.random.default_rng(7)
    for batch, block, heads in [(5, 16, 2), (19, 32, 3), (1, 16, 1)]:
        lengths = rng.integers(0, 120, size=batch)
        lengths[::4] = 0
        max_seqlen = max(int(lengths.max()), 1) + 5
        offs = np.concatenate([[0], np.cumsum(lengths)])
        tokens = int(offs[-1]) + 3
        so = torch.tensor(offs, device=dev)
        grid, table, G = _launch._schedule(
            so, tokens, heads, max_seqlen, block, key_major, on_device=True
        )
        assert grid == (G * heads,) and pairs(tokens, batch, max_seqlen, block) == G
        want = np.concatenate(schedule(np, offs, max_seqlen, G, block, key_major))
        np.testing.assert_array_equal(table.cpu().numpy(), want)


@pytest.mark.parametrize("mode", MODES)
def test_shared_schedules_build_each_table_once_per_step(mode, monkeypatch):
    """Two layers' attention (forward and backward) over one offsets tensor inside
    `shared_schedules`: one table per launch kind (forward, dq, dk / dv), not one per layer
    and kind; the same outputs and gradients as without it. An in-place write to the offsets
    builds the tables again; outside the context nothing is kept."""
    (q, k, v), so, kw, _, _, _ = _make_inputs(mode, "plain", torch.float32, 3)
    built = []
    real = _launch._build_schedule
    monkeypatch.setattr(_launch, "_build_schedule", lambda *a: built.append(a[4:6]) or real(*a))

    def two_layers():
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = hstu_attention(*xs, so, **kw)
        out = out + hstu_attention(xs[0].tanh(), xs[1], xs[2], so, **kw)
        grads = torch.autograd.grad(out.square().sum(), xs)
        return out.detach(), grads

    want = two_layers()
    assert len(built) == 6  # three launches a layer
    built.clear()
    with hstu_attention_module.shared_schedules():
        got = two_layers()
        kinds = len(set(built))  # (block, key_major) of each launch kind
        assert len(built) == kinds <= 3
        so.add_(0)  # a write: its version moves on
        with torch.no_grad():
            hstu_attention(q, k, v, so, **kw)  # a forward: its one launch kind
            assert len(built) == kinds + 1
            with hstu_attention_module.shared_schedules(share=False):  # e.g. two captures
                hstu_attention(q, k, v, so, **kw)
                hstu_attention(q, k, v, so, **kw)
            assert len(built) == kinds + 3
            hstu_attention(q, k, v, so, **kw)  # the outer context's table again
            assert len(built) == kinds + 3
    assert _launch._SHARED is None
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class _NanEmpty:
    """`torch` as `_launch` sees it, with `torch.empty` of floats filled with NaN: memory a
    kernel leaves unwritten shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kw):
        t = torch.empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backward", ["split", "stored"])
def test_capacity_padding_is_zeroed_by_the_kernels_tail_programs(
    mode, backward, monkeypatch, spy_launches
):
    """The rows past the last sample (capacity padding), which no attention program writes,
    come out zero from memory that held NaN: the forward's out by its kernel's tail programs;
    the backward's dq, dk, dv by the dq kernel's where they are adjacent columns of one buffer
    (v, q, k of the uvqk gradient `[u, v, q, k]`: one span, no launch of its own; the u
    columns and the real rows untouched), else by a `_zero_tail` launch each."""
    qkv, offsets, kw, _, grad_out, total = _make_inputs(mode, "ctx_cand", torch.bfloat16, 7)
    T, H, D = qkv[0].shape
    Dv = qkv[2].shape[2]
    monkeypatch.setattr(_launch, "torch", _NanEmpty())
    zeroed = []
    real = _launch._zero_tail
    monkeypatch.setattr(_launch, "_zero_tail", lambda x, so: zeroed.append(x.shape) or real(x, so))
    fwd = spy_launches(_launch, "_hstu_fwd_kernel")
    q, k, v = (x.to(torch.bfloat16) for x in qkv)
    bs = SHAPES[mode]["blocks"]["default"] or _launch.default_block_sizes(D, "fwd")
    fixed = (kw["max_seqlen"], kw["alpha"], kw["normalizer"], kw["num_contextual"],
             kw["num_candidates"], None, None, None)  # fmt: skip
    out = _launch._fwd_impl(q, k, v, offsets, *fixed, bs)
    assert fwd.meta[-1]["ZERO_TAIL"] and not zeroed
    assert bool((out[total:] == 0).all()) and bool(torch.isfinite(out[:total]).all())

    widths = [H * D, H * Dv, H * D, H * D]  # u, v, q, k
    grad = torch.full((T, sum(widths)), float("nan"), dtype=torch.bfloat16, device=q.device)
    grad[:, : H * D] = 1.0  # u: not the attention's
    u, gv, gq, gk = (c.unflatten(-1, (H, -1)) for c in grad.split(widths, dim=1))
    bwd = _launch._bwd_impl
    args = (grad_out.to(torch.bfloat16), q, k, v, offsets, *fixed, False, False)
    blocks = (None, None) if mode == "cuda" else (bs, bs)
    if mode == "cuda":
        dq_kernel = "dq_stored" if backward == "stored" else "dq"
        blocks = (_launch.default_block_sizes(D, "dkdv"), _launch.default_block_sizes(D, dq_kernel))
    name = "_hstu_bwd_dq_stored_kernel" if backward == "stored" else "_hstu_bwd_dq_kernel"
    dq_launch = spy_launches(_launch, name)
    got = bwd(*args, blocks, backward, out=(gq, gk, gv))
    assert got[0] is gq and dq_launch.meta[-1]["ZERO_TAIL"] and not zeroed
    assert bool((grad[total:, H * D :] == 0).all()), "the padding of dq, dk, dv"
    assert bool(torch.isfinite(grad[:total]).all()), "every real row written"
    assert bool((u == 1).all())
    # not adjacent (the op's own outputs): a launch each, the dq kernel's tail programs off
    dq, dk, dv = bwd(*args, blocks, backward)[:3]
    assert not dq_launch.meta[-1]["ZERO_TAIL"] and zeroed == [(T, H, D), (T, H, D), (T, H, Dv)]
    for name_, g, want in zip("qkv", (dq, dk, dv), (gq, gk, gv), strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0, msg=f"d{name_}")


def test_tail_spans_merge_adjacent_columns_only():
    """`_tail_spans`: dq, dk, dv as adjacent column ranges of one buffer are one `[T, 1,
    width]` view over them; with a gap between them (u, then q past v), each its own."""
    T, H, D = 40, 2, 8
    grad = torch.ones(T, 4 * H * D, dtype=torch.bfloat16)
    u, v, q, k = (grad[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
    (span,) = _launch._tail_spans((q, k, v))
    assert span.shape == (T, 1, 3 * H * D) and span.data_ptr() == v.data_ptr()
    assert span.stride() == (4 * H * D, 3 * H * D, 1)
    assert [x.data_ptr() for x in _launch._tail_spans((u, q))] == [u.data_ptr(), q.data_ptr()]


@pytest.mark.slow  # ~7 s of offline compiles on 2 cores, as the load probe's
def test_offline_resource_report_compiles_for_hopper_without_a_gpu():
    """`python -m hstu_kernels.triton.resources` compiles the kernels (forward, the split
    backward's two and the fused backward's one) for sm_90a on a machine without that GPU (its
    own process: the kernels here may be interpreted) and reports registers within the
    hardware's 255, spill bytes and shared memory for each kernel."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    cmd = [sys.executable, "-m", "hstu_kernels.triton.resources", "--dim", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    kernels = _launch.TILE_KERNELS
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[0] in kernels]
    assert [(r[0], r[2]) for r in rows] == [(k, "(default)") for k in kernels]
    for r in rows:
        regs, (stores, loads), smem = int(r[-3]), r[-2].split("/"), int(r[-1])
        assert 0 < regs <= 255 and int(stores) >= 0 and int(loads) >= 0 and smem > 0, r


@pytest.mark.slow  # a measurement aid's offline compile (~7 s on 2 cores): `make test-slow`
def test_load_probe_compiles_three_ways_for_hopper_without_a_gpu():
    """`python -m hstu_kernels.triton.probe_loads` compiles a dq-shaped loop with pointer,
    descriptor and warp-specialised descriptor loads for sm_90a on a CPU machine and reports
    each; descriptors hold fewer registers than pointer tiles (the lead in kernels/README.md),
    and warp specialisation adds warps for its producer (on this machine's pinned Triton)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    cmd = [sys.executable, "-m", "hstu_kernels.triton.probe_loads", "--dim", "64", "--tiles",
           "64,32,4,2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r[0]: r for r in (line.split() for line in out.stdout.splitlines()) if len(r) == 7}
    assert set(rows) == {"pointers", "descriptors", "descriptors+ws"}, out.stdout
    regs = {k: int(r[2]) for k, r in rows.items()}
    assert all(0 < x <= 255 for x in regs.values()), regs
    assert regs["descriptors"] < regs["pointers"], regs
    assert int(rows["descriptors"][5]) == 4 < int(rows["descriptors+ws"][5]), rows


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA or _INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("loop", ["dq", "fwd"])
def test_load_probe_variants_agree_and_are_timed_on_the_gpu(loop):
    """`probe_loads --time`: the pointer, descriptor and warp-specialised descriptor loops
    compute the same tiles (bf16 inputs, fp32 sums in a different order at most) and each
    gets a positive time; a variant this Triton cannot build says why instead of a time."""
    from hstu_kernels.triton.probe_loads import VARIANTS, time_variants

    rows = time_variants(64, 512, 4, "64,32,4,2", loop, repeats=5)
    assert [r["variant"] for r in rows] == list(VARIANTS)
    assert "failed" not in rows[0], rows[0]  # the pointer loop is the reference
    for r in rows:
        if "failed" in r:
            assert r["failed"], r
            continue
        assert r["ms"] > 0 and r["tflops"] > 0, r
        assert r["err"] < 2e-2, r


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA or _INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("with_masks", [False, True], ids=["causal", "ctx_cand_rab"])
def test_hstu_attention_seqlen_4096_bf16(with_masks):
    gen = torch.Generator().manual_seed(4096)
    B, N, H, D = 2, 4096, 4, 128
    dev = torch.device("cuda")
    offsets = torch.arange(B + 1, device=dev) * N
    q, k, v, grad_out = (
        torch.randn(B * N, H, D, generator=gen).to(dev, torch.bfloat16) for _ in range(4)
    )
    kw = dict(max_seqlen=N, alpha=1.0 / D**0.5, normalizer=float(N))
    if with_masks:
        kw["num_contextual"] = torch.tensor([16, 0], device=dev)
        kw["num_candidates"] = torch.tensor([200, 64], device=dev)
        kw["timestamps"] = torch.randint(0, 100, (B * N,), generator=gen).cumsum(0).to(dev)
        kw["rab_pos"] = (torch.randn(H, N, generator=gen) * 0.5).to(dev)
        kw["rab_time"] = (torch.randn(H, 32, generator=gen) * 0.5).to(dev)
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    out = hstu_attention(*leaves, offsets, **kw)
    (dq, dk, dv) = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    ref = hstu_attention_reference(*ref_leaves, offsets, **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.float())
    tol = TOL[torch.bfloat16]
    _assert_close(out, ref, tol, "out")
    for name, g, rg in zip("qkv", (dq, dk, dv), ref_grads):
        _assert_close(g, rg, tol, f"d{name}")


def test_block_sizes_name_a_bad_field_and_travel_through_the_ops_with_their_launch_order():
    for bad, field in (
        (dict(block_m=48), "block_m"),
        (dict(num_warps=0), "num_warps"),
        (dict(num_stages=0), "num_stages"),
        (dict(lead=-1), "lead"),
    ):
        with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
            BlockSizes(**bad)
    tiles = (BlockSizes(32, 16, 1, 1, lead=3), BlockSizes(16, 32), BlockSizes(64, 64, 8, 3, lead=0))
    packed = hstu_attention_module._pack_blocks(tiles)
    assert all(isinstance(x, int) for x in packed)  # the torch.library ops take int lists
    fwd, (dkdv, dq) = hstu_attention_module._unpack_blocks(packed)
    assert (fwd, dkdv, dq) == tiles


def test_launch_order_defaults_per_kernel():
    """A kernel's ``lead`` when BlockSizes leaves it None: the forward's default (0, head by
    head, measured faster), else every schedule entry with its heads; a set lead wins and is
    bounded by the schedule's entries."""
    lead = _launch.launch_lead  # the rule both backends' kernels take (kernels/tiles.py)
    assert lead("dq", BlockSizes().lead, 10) == lead("dkdv", None, 10) == 10  # entry by entry
    assert lead("fwd", BlockSizes().lead, 10) == 0  # the forward: head by head
    assert lead("fwd", BlockSizes(lead=3).lead, 10) == 3
    assert lead("dq", BlockSizes(lead=30).lead, 10) == 10


_common = importlib.import_module("hstu_kernels.triton._common")


@pytest.mark.skipif(not _INTERPRET, reason="the global is read at import when compiled")
@pytest.mark.parametrize("modes", [(1, 1), (2, 2)], ids=["per-bucket-sums", "row-sums"])
def test_time_tiles_give_the_same_bits(modes, monkeypatch):
    """`HSTU_TRITON_TIME_TILES=1` (`_common.TIME_TILES`): a key tile whose pairs all fall in one
    time bucket adds that bucket's entry once instead of a bucket and a gather per pair, and
    its table gradient is the tile's sum; the same outputs and gradients, bit for bit, as the
    per-pair path, with both table-gradient paths of the dq kernel (the test's timestamps put
    the far tiles of its longer samples wholly in the clamped last bucket)."""
    monkeypatch.setattr(_launch, "_table_grad_modes", lambda *_: modes)
    qkv, offsets, kw, tables, grad_out, _ = _make_inputs(
        "interpret", "ctx_cand_rab", torch.float32, 5
    )
    blocks = SHAPES["interpret"]["blocks"]["default"]

    def run(on):
        monkeypatch.setattr(_common, "TIME_TILES", _common.tl.constexpr(on))
        leaves = [x.clone().requires_grad_() for x in [*qkv, *tables.values()]]
        out = hstu_attention(*leaves[:3], offsets, **kw, block_sizes=blocks,
                             **dict(zip(tables, leaves[3:], strict=True)))  # fmt: skip
        return [out, *torch.autograd.grad(out, leaves, grad_out)]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _INTERPRET, reason="a probe kernel, interpreted")
def test_time_tile_claims_one_bucket_only_where_every_pair_is_in_it(monkeypatch):
    """`_time_tile` on tiles of timestamps: one bucket exactly when the distances the two
    ranges allow share it (floor(log2(1 + |dt|)), clamped into the last of TB)."""
    import triton
    import triton.language as tl

    monkeypatch.setattr(_common, "TIME_TILES", tl.constexpr(True))

    @triton.jit
    def probe(Tq, Tk, Out, TB, HAS_TIME: tl.constexpr):
        tq = tl.load(Tq + tl.arange(0, 4))[:, None]
        tk = tl.load(Tk + tl.arange(0, 4))[None, :]
        uniform, b = _common._time_tile(tq, tk, TB, HAS_TIME)
        tl.store(Out, uniform.to(tl.int32))
        tl.store(Out + 1, b)

    def claim(tq, tk, tb=8):
        out = torch.zeros(2, dtype=torch.int32)
        ts = [torch.tensor(t, dtype=torch.int64) for t in (tq, tk)]
        probe[(1,)](*ts, out, tb, HAS_TIME=1)
        return bool(out[0]), int(out[1])

    assert claim([1000, 1010, 1020, 1030], [0, 1, 2, 3]) == (True, 7)  # all clamped (>= 127)
    assert claim([40, 41, 42, 43], [0, 1, 2, 3]) == (True, 5)  # |dt| in 37..43: bucket 5
    assert claim([40, 41, 42, 90], [0, 1, 2, 3])[0] is False  # 37..90: buckets 5 and 6
    assert claim([0, 1, 2, 3], [40, 41, 42, 43]) == (True, 5)  # keys after the queries
    assert claim([0, 5, 9, 3], [2, 4, 6, 8])[0] is False  # overlapping ranges: 0 is possible
