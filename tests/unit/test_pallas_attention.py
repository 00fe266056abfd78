"""Pallas HSTU attention vs the jnp reference (forward and gradients).

One test body, parametrised by mode: ``interpret`` runs the Pallas interpreter on CPU with
small shapes and tiny tiles; ``gpu`` compiles the Triton kernels and is skipped without a
GPU. Each case draws fresh seeded inputs and covers, in one jagged batch, samples with no
contextual / candidate tokens, contextual only, candidates only, both, a zero-length and
a length-1 sample, plus capacity padding past ``seq_offsets[-1]``.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from hstu_kernels.pallas import (  # noqa: E402
    KERNELS,
    BlockSizes,
    default_block_sizes,
    hstu_attention,
    hstu_attention_reference,
    hstu_mask_reference,
)

# name -> (lengths, heads, dqk, dv, dtype, features, block sizes, capacity padding)
# lengths: per-sample (n, C, K). features: subset of {"ctx", "cand", "pos", "time"}.
# block sizes: (block_q, block_k) for every kernel, or one pair per kernel (fwd, dkdv, dq).
_MIXED = [(9, 0, 0), (13, 3, 0), (0, 0, 0), (11, 0, 4), (1, 0, 0), (37, 5, 6), (6, 2, 1)]
CASES = {
    "plain_f32": ([(n, 0, 0) for n, _, _ in _MIXED], 2, 32, 32, "float32", (), (16, 16), 5),
    "all_f32": (_MIXED, 2, 24, 20, "float32", ("ctx", "cand", "pos", "time"), (16, 32), 7),
    "all_bf16": (
        _MIXED,
        2,
        32,
        32,
        "bfloat16",
        ("ctx", "cand", "pos", "time"),
        ((32, 16), (16, 32), (16, 16)),
        3,
    ),  # fmt: skip
    "ctx_cand_pos_f16": (_MIXED, 1, 16, 16, "float16", ("ctx", "cand", "pos"), (16, 16), 0),
    # GPU only: the kernel's target shape (seqlen 4096, bf16, H=4, D=128).
    "long_bf16": ([(4096, 0, 0), (3001, 64, 128)], 4, 128, 128, "bfloat16", (), (64, 64), 64),
}
GPU_ONLY = {"long_bf16"}

# max |kernel - reference| / max |reference|, per input dtype.
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 5e-3}
TOL_GPU_F32 = 1e-4  # Triton's fp32 dot and exp differ slightly from XLA's

# ~11-12 s each interpreted; in `make test` all_bf16 runs every feature and plain_f32 fp32
SLOW_ON_CPU = {"all_f32", "ctx_cand_pos_f16"}
PARAMS = [
    pytest.param(
        "interpret",
        case,
        id=f"interpret-{case}",
        marks=[pytest.mark.slow] if case in SLOW_ON_CPU else [],
    )
    for case in CASES
    if case not in GPU_ONLY
] + [pytest.param("gpu", case, id=f"gpu-{case}", marks=pytest.mark.gpu) for case in CASES]


def _make_inputs(case: str):
    lengths, heads, dqk, dv, dtype, feats, _, pad = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    n = np.array([x[0] for x in lengths], np.int32)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    t_cap = int(offs[-1]) + pad
    max_seqlen = int(n.max()) + 3  # a loose bound, as a config value would be
    dt = jnp.dtype(dtype)

    def rand(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    args = dict(
        q=rand(t_cap, heads, dqk).astype(dt),
        k=rand(t_cap, heads, dqk).astype(dt),
        v=rand(t_cap, heads, dv).astype(dt),
        seq_offsets=jnp.asarray(offs),
    )
    kw = dict(max_seqlen=max_seqlen, alpha=1.0 / np.sqrt(dqk), normalizer=float(max_seqlen))
    if "ctx" in feats:
        kw["num_contextual"] = jnp.asarray([x[1] for x in lengths], jnp.int32)
    if "cand" in feats:
        kw["num_candidates"] = jnp.asarray([x[2] for x in lengths], jnp.int32)
    if "pos" in feats:
        kw["rab_pos"] = rand(heads, max(2, max_seqlen // 2), scale=0.5)
    if "time" in feats:
        kw["timestamps"] = jnp.asarray(np.sort(rng.integers(0, 1 << 20, t_cap)), jnp.int32)
        kw["rab_time"] = rand(heads, 16, scale=0.5)
    cot = rand(t_cap, heads, dv)
    return args, kw, cot


def _rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


@pytest.mark.parametrize(("mode", "case"), PARAMS)
def test_matches_reference(mode, case):
    if mode == "gpu" and jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args, kw, cot = _make_inputs(case)
    _, _, _, _, dtype, _, tiles, _ = CASES[case]
    per_kernel = tiles if isinstance(tiles[0], tuple) else (tiles,) * 3
    blocks = tuple(BlockSizes(block_q=bq, block_k=bk, num_warps=4, num_stages=2)
                   for bq, bk in per_kernel)  # fmt: skip
    interpret = mode == "interpret"
    diff = ["q", "k", "v"] + [t for t in ("rab_pos", "rab_time") if t in kw]

    def run(fn, **extra):
        def f(*xs):
            a = dict(args, **dict(zip(diff[:3], xs[:3])))
            w = dict(kw, **dict(zip(diff[3:], xs[3:])))
            return fn(a["q"], a["k"], a["v"], a["seq_offsets"], **w, **extra)

        primals = [args[n] for n in diff[:3]] + [kw[n] for n in diff[3:]]
        out, vjp = jax.vjp(f, *primals)
        return out, vjp(cot.astype(out.dtype))

    out, grads = run(hstu_attention, block_sizes=blocks, interpret=interpret)
    # The reference runs in fp32 on the same (rounded) inputs.
    args = {n: (x.astype(jnp.float32) if n in ("q", "k", "v") else x) for n, x in args.items()}
    ref_out, ref_grads = run(hstu_attention_reference)

    assert out.dtype == jnp.dtype(dtype) and out.shape == ref_out.shape
    tol = TOL[dtype] if (dtype != "float32" or interpret) else TOL_GPU_F32
    end = int(args["seq_offsets"][-1])
    assert not np.any(np.asarray(out[end:], np.float32)), "capacity padding must be zero"
    errs = {"out": _rel_err(out, ref_out)}
    for name, g, rg in zip(diff, grads, ref_grads, strict=True):
        assert g.shape == rg.shape, name
        errs[f"d{name}"] = _rel_err(g, rg)
        if name in ("q", "k", "v"):
            assert not np.any(np.asarray(g[end:], np.float32)), f"d{name} padding rows"
    # bf16 gradients of the bias tables sum ~T^2 rounded terms: allow a little more.
    limits = {e: tol * (2 if e.startswith("drab") else 1) for e in errs}
    print(case, mode, errs)
    bad = {e: v for e, v in errs.items() if not v <= limits[e]}
    assert not bad, f"errors {errs} (limits {limits})"


def test_mask_matches_brute_force():
    rng = np.random.default_rng(7)
    max_seqlen = 11
    combos = list(itertools.product([0, 1, 4, 11], [0, 1, 3, 12], [0, 2, 5, 11]))
    lengths = np.array([c[0] for c in combos], np.int32)
    ctx = np.array([c[1] for c in combos], np.int32)
    cand = np.array([c[2] for c in combos], np.int32)
    perm = rng.permutation(len(combos))
    lengths, ctx, cand = lengths[perm], ctx[perm], cand[perm]
    got = np.asarray(
        hstu_mask_reference(jnp.asarray(lengths), max_seqlen, jnp.asarray(ctx), jnp.asarray(cand))
    )
    want = np.zeros_like(got)
    for b in range(len(lengths)):
        n, c, kk = int(lengths[b]), int(ctx[b]), int(cand[b])
        for i in range(n):
            for j in range(n):
                want[b, i, j] = (i == j) or (j < n - kk and (j <= i or i < c))
    np.testing.assert_array_equal(got, want)
    none = np.asarray(hstu_mask_reference(jnp.asarray(lengths), max_seqlen))
    causal = np.tril(np.ones((max_seqlen, max_seqlen), bool))[None]
    valid = np.arange(max_seqlen)[None, :] < lengths[:, None]
    np.testing.assert_array_equal(none, causal & valid[:, :, None] & valid[:, None, :])


@pytest.mark.parametrize(
    ("bad", "name"),
    [
        (dict(k=np.zeros((8, 2, 8), np.float32)), "k"),
        (dict(seq_offsets=np.zeros((2, 2), np.int32)), "seq_offsets"),
        (dict(num_contextual=np.zeros((3,), np.int32)), "num_contextual"),
        (dict(rab_pos=np.zeros((3, 4), np.float32)), "rab_pos"),
        (dict(rab_time=np.zeros((2, 4), np.float32)), "timestamps"),
        (dict(max_seqlen=0), "max_seqlen"),
        (dict(block_sizes=(BlockSizes(),) * 4), "block_sizes"),
        (dict(block_sizes=(64, 32)), "block_sizes"),
    ],
)
def test_rejects_bad_shapes(bad, name):
    args = dict(
        q=np.zeros((8, 2, 16), np.float32),
        k=np.zeros((8, 2, 16), np.float32),
        v=np.zeros((8, 2, 16), np.float32),
        seq_offsets=np.array([0, 3, 8], np.int32),
        max_seqlen=8,
        alpha=1.0,
        normalizer=8.0,
    )
    args.update(bad)
    args = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in args.items()}
    with pytest.raises(ValueError, match=name):
        hstu_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("seq_offsets"), **args)


def test_default_tiles_per_kernel():
    """Compiled 16-bit inputs read the tuned row of their head dim, kernel by kernel; fp32
    and interpret mode keep ``BlockSizes()``."""
    from hstu_kernels.pallas import _common

    for dim, row in ((64, 64), (96, 128), (200, 256), (256, 256)):
        for kernel in KERNELS:
            expected = _common._TUNED.get(row, {}).get(kernel, BlockSizes())
            assert default_block_sizes(dim, kernel, jnp.bfloat16) == expected
            assert default_block_sizes(dim, kernel, jnp.float32) == BlockSizes()
            assert default_block_sizes(dim, kernel, jnp.bfloat16, interpret=True) == BlockSizes()
    with pytest.raises(ValueError, match="kernel"):
        default_block_sizes(128, "bwd")


def test_bench_timer_dispatches_calls_back_to_back():
    """`bench._median_time(..., calls=N)`: each repeat runs N calls before one wait and
    reports the time per call (the tile sweep's timer: one dispatch wait per repeat)."""
    from hstu_kernels.pallas.bench import _median_time

    seen = []

    def fn(x):
        seen.append(1)
        return x + 1

    sec = _median_time(fn, (jnp.ones(4),), warmup=1, repeats=2, calls=3)
    assert len(seen) == 1 + 2 * 3 and 0 < sec < 1
