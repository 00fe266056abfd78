"""Microbenchmark: Triton HSTU attention vs the torch reference on CUDA.

    python -m hstu_kernels.triton.bench [--seqlens 512,1024,2048,4096] [--batch 4] ...

FLOPs count only unmasked (query, key) pairs: forward = 4 * pairs * H * D (2 for QK^T and
2 for PV), backward = 2.5 x forward, so forward + backward = 3.5 x forward.
"""

import argparse
import statistics

import torch

from .hstu_attention import BlockSizes, hstu_attention
from .reference import hstu_attention_reference, hstu_mask_reference

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_ms(fn, warmup: int, repeats: int) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def captured_graph(fn, calls: int = 1, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """``calls`` calls of ``fn()`` captured in one CUDA graph, after ``warmup`` calls on a side
    stream (Triton's compiles, cuBLAS's handles and the allocator's blocks made outside the
    capture); the graph replayed once before it is returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph, rounds: int, calls: int = 1) -> float:
    """Median device ms of one replay of ``graph`` over ``rounds`` replays between CUDA events,
    divided by the ``calls`` it holds."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_time_ms(fn, calls: int, rounds: int) -> float:
    """Median device ms per call of ``fn()``: ``calls`` calls captured in one CUDA graph
    (after two warm-up calls on a side stream), the graph replayed ``rounds`` times between
    CUDA events. The host's launch work is not in the figure, only what the kernels cost."""
    return replay_ms(captured_graph(fn, calls), rounds, calls)


def kernel_profile(fn, calls: int) -> list[tuple[str, float, int]]:
    """(kernel name, device ms per call, launches per call) of ``fn()``, slowest first:
    torch.profiler over ``calls`` calls after one warm-up call, totals divided by ``calls``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [
        (ev.key, ev.device_time_total / calls / 1e3, ev.count // calls)
        for ev in prof.key_averages()
        if ev.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])


def _make_case(seqlen, batch, heads, dim, dtype, rab, num_contextual, num_candidates):
    dev = torch.device("cuda")
    T = seqlen * batch
    q, k, v, grad = (torch.randn(T, heads, dim, device=dev, dtype=dtype) for _ in range(4))
    kw = dict(max_seqlen=seqlen, alpha=1.0 / dim**0.5, normalizer=float(seqlen))
    if num_contextual:
        kw["num_contextual"] = torch.full((batch,), num_contextual, device=dev)
    if num_candidates:
        kw["num_candidates"] = torch.full((batch,), num_candidates, device=dev)
    if rab:
        kw["rab_pos"] = torch.randn(heads, seqlen, device=dev, requires_grad=True)
        kw["rab_time"] = torch.randn(heads, 32, device=dev, requires_grad=True)
        kw["timestamps"] = torch.randint(0, 100, (T,), device=dev).cumsum(0)
    offsets = torch.arange(batch + 1, device=dev) * seqlen
    mask = hstu_mask_reference(seqlen, num_contextual, num_candidates, device=dev)
    pairs = int(mask.sum()) * batch
    return (q, k, v), grad, offsets, kw, pairs


def _measure(fn, inputs, grad, offsets, kw, warmup, repeats, extra):
    leaves = [x.detach().requires_grad_() for x in inputs]
    tables = [t for t in (kw.get("rab_pos"), kw.get("rab_time")) if t is not None]

    def fwd():
        with torch.no_grad():
            return fn(*leaves, offsets, **kw, **extra)

    def fwd_bwd():
        out = fn(*leaves, offsets, **kw, **extra)
        return torch.autograd.grad(out, leaves + tables, grad)

    try:
        return _time_ms(fwd, warmup, repeats), _time_ms(fwd_bwd, warmup, repeats)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan"), float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rab", action="store_true", help="add rab_pos and rab_time")
    ap.add_argument("--num-contextual", type=int, default=0)
    ap.add_argument("--num-candidates", type=int, default=0)
    ap.add_argument("--no-reference", action="store_true", help="skip the torch reference")
    ap.add_argument(
        "--blocks",
        default=None,
        help="block_m,block_n,num_warps,num_stages for both passes "
        "(or 8 numbers: forward then backward); default: built-in defaults",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA device")

    extra = {}
    if args.blocks:
        nums = [int(x) for x in args.blocks.split(",")]
        if len(nums) == 4:
            extra["block_sizes"] = BlockSizes(*nums)
        elif len(nums) == 8:
            extra["block_sizes"] = (BlockSizes(*nums[:4]), BlockSizes(*nums[4:]))
        else:
            raise SystemExit("--blocks takes 4 or 8 comma-separated ints")

    dtype = _DTYPES[args.dtype]
    print(
        f"# HSTU attention, {torch.cuda.get_device_name()}, batch={args.batch} "
        f"heads={args.heads} dim={args.dim} {args.dtype} causal"
        + (f" contextual={args.num_contextual}" if args.num_contextual else "")
        + (f" candidates={args.num_candidates}" if args.num_candidates else "")
        + (" +rab" if args.rab else "")
    )
    head = (
        f"{'seqlen':>6} {'impl':>9} {'fwd ms':>9} {'fwd TF/s':>9} "
        f"{'fwd+bwd ms':>11} {'f+b TF/s':>9} {'speedup f/f+b':>14}"
    )
    print(head)
    print("-" * len(head))
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        inputs, grad, offsets, kw, pairs = _make_case(
            seqlen, args.batch, args.heads, args.dim, dtype, args.rab,
            args.num_contextual, args.num_candidates,
        )  # fmt: skip
        fwd_flops = 4.0 * pairs * args.heads * args.dim
        rows = [("triton", hstu_attention, extra)]
        if not args.no_reference:
            rows.append(("reference", hstu_attention_reference, {}))
        results = {}
        for name, fn, ex in rows:
            results[name] = _measure(fn, inputs, grad, offsets, kw, args.warmup, args.repeats, ex)
        for name, _, _ in rows:
            f_ms, fb_ms = results[name]
            speed = ""
            if name == "triton" and "reference" in results:
                rf, rfb = results["reference"]
                speed = f"{rf / f_ms:6.1f}x/{rfb / fb_ms:5.1f}x"
            print(
                f"{seqlen:>6} {name:>9} {f_ms:>9.3f} {fwd_flops / f_ms / 1e9:>9.1f} "
                f"{fb_ms:>11.3f} {3.5 * fwd_flops / fb_ms / 1e9:>9.1f} {speed:>14}"
            )
        del inputs, grad, kw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
