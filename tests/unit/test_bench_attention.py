"""`hstu bench attention`: the grid, correctness before timing, the files; both backends on a
tiny grid (kernels interpreted on CPU: the check is real, the timings are not)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hstu import backends
from hstu.bench import attention as ba
from hstu.cli import main
from hstu.testing import load_script


def _args(**kw):
    base = dict(
        dims=(16,), seqlens=(16, 64), batches=(1, 4, 64), heads=2, dtype="fp32",
        rab=False, jagged="zipf", max_tokens=256,
    )  # fmt: skip
    return SimpleNamespace(**(base | kw))


def test_grid_keeps_the_token_budget_and_pairs_jagged_batches_with_equal_ones():
    cases = ba.grid(_args())
    assert {(c.batch, c.seqlen) for c in cases} == {(1, 16), (4, 16), (1, 64), (4, 64)}
    for equal, zipf in zip(cases[::2], cases[1::2], strict=True):
        assert (equal.layout, zipf.layout) == ("equal", "zipf")
        assert equal.tokens == zipf.tokens == equal.batch * equal.seqlen
        assert max(zipf.lengths) <= zipf.seqlen and min(zipf.lengths) >= 1
        assert zipf.pairs <= equal.pairs
    c = ba.Case(2, 8, 16, 2, "fp32", "equal", (8, 8))
    assert c.pairs == 2 * 36 and c.fwd_flops == 4.0 * 72 * 2 * 16
    with pytest.raises(Exception, match="--max-tokens=8"):
        ba.grid(_args(max_tokens=8))


def test_check_slice_is_one_sample_or_the_first_samples_up_to_seqlen():
    assert ba.Case(4, 64, 16, 2, "fp32", "equal", (64,) * 4).check_slice().lengths == (64,)
    jagged = ba.Case(4, 64, 16, 2, "fp32", "zipf", (30, 20, 40, 10, 100 - 0))
    assert jagged.check_slice().lengths == (30, 20)


def test_a_point_that_fails_the_check_is_not_timed_and_fails_the_run():
    class Wrong:
        kernel = "wrong"

        def check(self, case):
            return {"out": 0.5, "dq": float("nan")}

        def time(self, case, warmup, repeats):  # never reached
            raise AssertionError("a failed point must not be timed")

        def extra_kernels(self, case):
            return []

    points = ba.run(Wrong(), ba.grid(_args(jagged="none", seqlens=(16,))), 0, 1, say=lambda s: 0)
    assert all(not p.check["ok"] and p.check["failed"] == ["dq", "out"] for p in points)
    assert all(np.isnan(p.fwd_ms) for p in points)
    assert "FAIL" in ba.table(points)


class _Stub:
    """A runner whose timings are known (ms = batch / 10) and that can lose its device at a
    given batch: what `--resume` and the per-point report are about, not the kernel."""

    kernel, device, interpret = "stub", "Stub GPU", False
    timed: list = []
    lose_at: int | None = None

    def __init__(self, sdpa: bool = True):
        pass

    def check(self, case):
        return {"out": 0.0}

    def time(self, case, warmup, repeats):
        if case.batch == _Stub.lose_at:
            raise RuntimeError("device lost")
        _Stub.timed.append(case.batch)
        return case.batch / 10, 3 * case.batch / 10, ""

    def extra_kernels(self, case):
        return []


def test_a_cut_run_keeps_its_points_and_resume_times_only_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(ba, "_runner_class", lambda backend: _Stub)
    monkeypatch.setattr(_Stub, "timed", [])
    argv = ["--backend", "torch", "--seqlens", "16", "--dims", "16", "--jagged", "none"]
    argv += ["--out", str(tmp_path)]
    monkeypatch.setattr(_Stub, "lose_at", 4)
    with pytest.raises(RuntimeError, match="device lost"):
        ba.main([*argv, "--batches", "1,2,4"])
    path = tmp_path / "attention_torch.json"
    kept = json.loads(path.read_text())["points"]
    assert [(p["case"]["batch"], p["fwd_ms"]) for p in kept] == [(1, 0.1), (2, 0.2)]

    monkeypatch.setattr(_Stub, "lose_at", None)
    _Stub.timed.clear()
    assert ba.main([*argv, "--batches", "1,2,4,8", "--resume"]) == 0
    assert _Stub.timed == [4, 8]  # the kept points are not timed again
    points = json.loads(path.read_text())["points"]
    assert [(p["case"]["batch"], p["fwd_bwd_ms"]) for p in points] == [
        (1, pytest.approx(0.3)), (2, pytest.approx(0.6)), (4, pytest.approx(1.2)),
        (8, pytest.approx(2.4)),
    ]  # fmt: skip
    _Stub.timed.clear()
    assert ba.main([*argv, "--batches", "1,2"]) == 0  # no --resume: everything again
    assert _Stub.timed == [1, 2]


def test_resume_refuses_a_report_of_another_device(tmp_path, monkeypatch):
    monkeypatch.setattr(ba, "_runner_class", lambda backend: _Stub)
    monkeypatch.setattr(_Stub, "timed", [])
    argv = ["--backend", "torch", "--batches", "1", "--seqlens", "16", "--dims", "16"]
    argv += ["--out", str(tmp_path)]
    assert ba.main(argv) == 0
    monkeypatch.setattr(_Stub, "device", "Another GPU")
    with pytest.raises(Exception, match="'Stub GPU'.*'Another GPU'.*another --out"):
        ba.main([*argv, "--resume"])
    assert _Stub.timed == [1, 1]  # the equal and the Zipf batch, once: nothing after the refusal


def test_zipf_points_read_back_with_their_lengths():
    case = ba.grid(_args())[1]
    assert case.layout == "zipf"
    back = ba.point_of(ba.Point("k", case, {"ok": True}, 1.0, 2.0, "").as_dict())
    assert back.case == case


@pytest.mark.slow  # ~10 s per backend on 2 cores: with the other end-to-end commands
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_bench_attention_checks_times_and_writes(backend, tmp_path, capsys):
    ok, why = backends.available(backend)
    if not ok:
        pytest.skip(why)
    batches = "1,2" if backend == "torch" else "1"  # each JAX shape compiles: keep it short
    argv = ["bench", "attention", "--backend", backend, "--batches", batches, "--seqlens", "32"]
    argv += ["--dims", "16", "--heads", "2", "--dtype", "fp32", "--warmup", "0", "--repeats", "1"]
    argv += ["--rab", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    kernel = {"torch": "triton", "jax": "pallas"}[backend]
    assert "jagged (zipf) / equal" in out
    report = json.loads((tmp_path / f"attention_{backend}.json").read_text())
    points = [p for p in report["points"] if p["kernel"] == kernel]
    expected = [(b, layout) for b in map(int, batches.split(",")) for layout in ("equal", "zipf")]
    assert [(p["case"]["batch"], p["case"]["layout"]) for p in points] == expected
    for p in points:
        errors = p["check"]["errors"]
        assert set(errors) == {"out", "dq", "dk", "dv", "drab_pos", "drab_time"}
        assert max(errors.values()) < 1e-4  # fp32: the kernel equals the reference
        assert p["fwd_ms"] > 0 and p["fwd_bwd_ms"] > 0
        flops = 4.0 * p["case"]["pairs"] * 2 * 16
        assert p["fwd_tflops"] == pytest.approx(flops / p["fwd_ms"] / 1e9)
    assert (tmp_path / f"attention_{kernel}_d16.png").stat().st_size > 1000


def test_lowerings_are_checked_before_any_work(tmp_path, capsys):
    base = ["bench", "attention", "--batches", "1", "--seqlens", "16", "--dims", "16"]
    base += ["--out", str(tmp_path)]
    with pytest.raises(SystemExit):  # argparse: not a lowering
        main([*base, "--backend", "jax", "--lowerings", "triton,cuda"])
    assert ba._lowerings("mosaic, triton,mosaic") == ("mosaic", "triton")
    if backends.available("torch")[0]:
        assert main([*base, "--backend", "torch", "--lowerings", "mosaic"]) == 2
        assert "--lowerings is for --backend jax" in capsys.readouterr().err
    if backends.available("jax")[0]:  # fp32 here: Mosaic GPU takes 16-bit inputs only
        argv = [*base, "--backend", "jax", "--dtype", "fp32", "--lowerings", "triton,mosaic"]
        assert main(argv) == 2
        assert "--lowerings mosaic: head dim 16: dtype float32" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.gpu
def test_torch_timing_replays_the_kernel_from_a_cuda_graph():
    """On a GPU the torch runner times a graph replay (device time), and the replay computes
    what the eager call computes: the gradients of the kernel, forward and backward."""
    torch = pytest.importorskip("torch")
    from hstu.torch_backend.bench_attention import Runner

    runner = Runner(sdpa=False)
    case = ba.Case(2, 256, 64, 2, "bf16", "equal", (256, 256))
    leaves, do, offsets, kw = runner.inputs(case)
    xs = [x.requires_grad_() for x in leaves]
    grads = []

    def fwd_bwd():
        grads[:] = torch.autograd.grad(runner.fn(*xs, offsets, **kw), xs, do)

    fwd_bwd()
    want = [g.clone() for g in grads]
    graph = runner._capture(fwd_bwd)
    assert graph is not None and runner.eager == []
    for g in grads:
        g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(grads, want, strict=True):
        assert torch.equal(got, ref)
    fwd_ms, fwd_bwd_ms, note = runner.time(case, warmup=2, repeats=5)
    assert note == "" and 0 < fwd_ms < fwd_bwd_ms


def test_jax_device_time_reads_the_trace_or_says_none_on_a_cpu():
    """`device_ms` traces its bursts; on a CPU the trace holds no device events, so it answers
    None (the runners then time on the host's clock) instead of a figure of host threads."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU answer; tested against device work on a GPU below")
    from hstu.jax_backend.device_time import device_ms

    f = jax.jit(lambda x: x @ x)
    runs = {"mm": (f, (jax.numpy.ones((64, 64)),))}
    assert device_ms(runs, calls=2, rounds=2) is None


def test_jax_device_time_steps_aside_for_a_running_trace(tmp_path):
    """Inside the caller's own `jax.profiler` trace (one at a time) `device_ms` answers None
    instead of failing, and leaves that trace running."""
    jax = pytest.importorskip("jax")
    from hstu.jax_backend.device_time import device_ms

    f = jax.jit(lambda x: x @ x)
    with jax.profiler.trace(str(tmp_path)):
        assert device_ms({"mm": (f, (jax.numpy.ones((64, 64)),))}, calls=1, rounds=1) is None
        jax.block_until_ready(f(jax.numpy.ones((64, 64))))
    assert list(tmp_path.rglob("*.xplane.pb"))  # the caller's trace was written


@pytest.mark.gpu
def test_jax_device_time_scales_with_the_device_work():
    """On a GPU: four chained matmuls take four times one matmul's device time (not a host
    clock's, whose fixed dispatch and wait would make the ratio smaller), and the figure
    holds from one call a round to ten."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from hstu.jax_backend.device_time import device_ms

    x = jnp.ones((4096, 4096), jnp.bfloat16) / 4096

    def chain(n):
        def f(a):
            for _ in range(n):
                a = a @ x
            return a

        return jax.jit(f)

    ms = device_ms({"one": (chain(1), (x,)), "four": (chain(4), (x,))}, calls=10, rounds=5)
    assert ms["one"] > 0 and ms["four"] / ms["one"] == pytest.approx(4.0, rel=0.15)
    once = device_ms({"one": (chain(1), (x,))}, calls=1, rounds=5)
    assert once["one"] == pytest.approx(ms["one"], rel=0.15)


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from hstu.cli import main
sys.exit(main({argv!r}))
"""


def _run_blocked(blocked: set[str], argv: list[str]):
    import subprocess
    import sys

    code = _BLOCK.format(blocked=sorted(blocked), argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_torch_kernel_bench_needs_neither_torchrec_nor_fbgemm(tmp_path):
    """`hstu bench attention --backend torch` imports torch and the Triton kernels only: with
    TorchRec and fbgemm unimportable it still checks and times the kernel; without torch it
    says which package is missing."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    argv = ["bench", "attention", "--backend", "torch", "--batches", "1", "--seqlens", "16"]
    argv += ["--dims", "16", "--heads", "1", "--dtype", "fp32", "--jagged", "none"]
    argv += ["--warmup", "0", "--repeats", "1", "--no-sdpa", "--out", str(tmp_path)]
    done = _run_blocked({"torchrec", "fbgemm_gpu"}, argv)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "attention_torch.json").read_text())
    assert [p["check"]["ok"] for p in report["points"]] == [True]
    done = _run_blocked({"torch"}, argv)
    assert done.returncode == 2
    assert "the kernel benchmark needs the package 'torch'" in done.stderr


# ------------------------------------------------------------- scripts/attention_jagged.py
def test_attention_jagged_times_batches_at_a_training_capacity(capsys):
    """The script's arrays hold each batch as a training step does, at a capacity (a multiple
    of `hstu.capacity.ALIGN` rows), unless asked for exactly the batch's tokens; the cells are
    then timed on those arrays (here on the CPU, the host's clock, through the interpreter)."""
    from hstu.capacity import ALIGN

    script = load_script("attention_jagged")
    assert script.rows([100, 30]) == ALIGN
    assert script.rows([ALIGN]) == ALIGN
    assert script.rows([ALIGN, 1]) == 2 * ALIGN
    assert script.rows([100, 30], exact=True) == 130
    script.main(["--backend", "jax", "--dim", "16", "--heads", "1", "--no-recipe",
                 "--equal", "2x40", "--calls", "1", "--rounds", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert f"rows: tokens up to a multiple of {ALIGN}" in out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("2 x 40"))
    assert int(row[3]) == 80 and float(row[4]) > 0 and float(row[6]) > 0


def test_attention_jagged_sets_the_mosaic_launch_order_per_kernel():
    """`--lead KERNEL=N` sets that kernel's launch order (`MosaicTiles.lead`, torch's
    `BlockSizes.lead`) over its default tiles, the others keep theirs; a malformed item, or the
    jax Triton lowering (no such knob), is refused before anything runs."""
    pytest.importorskip("jax")
    script = load_script("attention_jagged")
    assert script._parse_lead(["fwd=0", "dq=33"]) == {"fwd": 0, "dq": 33}
    assert script._mosaic_tiles({}, 256) is None
    fwd, dq, dkdv = script._mosaic_tiles({"dq": 5}, 256)
    assert (fwd.lead, dq.lead, dkdv.lead) == (None, 5, None)
    assert dq.block_kv == 32  # dq's own default tiles at head dim 256 (shared memory)
    pytest.importorskip("triton")
    fwd, dkdv, dq = script._torch_tiles({"dq": (32, 32, 4, 1)}, 128, {"fwd": 0, "dq": 7})
    assert (fwd.lead, dkdv.lead, dq.lead) == (0, None, 7) and dq.block_m == 32
    assert script._torch_tiles({}, 128, {}) is None
    for bad in (["dq=-1"], ["attn=3"], ["dq"]):
        with pytest.raises(SystemExit, match="--lead"):
            script._parse_lead(bad)
    with pytest.raises(SystemExit, match="--lead"):
        script.main(["--backend", "jax", "--lowering", "triton", "--lead", "dq=1", "--no-recipe"])


def test_attention_jagged_sets_mosaic_tiles_per_kernel_and_refuses_what_cannot_run():
    """jax with the Mosaic lowering: `--tiles KERNEL=block_kv,stages` over that kernel's
    defaults (the others keep theirs); tiles that do not fit in shared memory, a malformed item
    or the Triton lowering are refused before anything compiles."""
    pytest.importorskip("jax")
    script = load_script("attention_jagged")
    assert script._parse_tiles(["fwd=32,3"], 2) == {"fwd": (32, 3)}
    fwd, dq, dkdv = script._mosaic_tiles({"dq": 4}, 256, {"fwd": (32, 3)})
    assert (fwd.block_kv, fwd.stages, fwd.lead) == (32, 3, None)
    assert (dq.block_kv, dq.stages, dq.lead) == (32, 3, 4)  # dq's defaults at head dim 256
    assert (dkdv.block_kv, dkdv.stages) == (64, 2)
    base = ["--backend", "jax", "--lowering", "mosaic", "--no-recipe", "--equal", "1x64"]
    for bad, why in (
        (["dq=64,2"], "shared memory"),  # 64-row dq tiles do not fit at head dim 256
        (["fwd=48,2"], "block_kv"),
        (["fwd=32"], "block_kv,stages"),
        (["fwd=32,3,4,2"], "block_kv,stages"),
    ):
        with pytest.raises(SystemExit, match=why):
            script.main([*base, "--tiles", *bad])
    with pytest.raises(SystemExit, match="--tiles"):
        script.main(["--backend", "jax", "--tiles", "fwd=32,3", "--no-recipe"])
