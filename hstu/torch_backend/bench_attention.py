"""The torch half of `hstu bench attention`: our Triton kernel, checked against the fp32 torch
reference, timed with CUDA events; `scaled_dot_product_attention` (causal softmax) as the
yardstick on equal-length batches. On a CPU the Triton kernel needs `TRITON_INTERPRET=1` set
before the process starts (the interpreter; timings are then meaningless)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from hstu.bench.attention import Case
from hstu.errors import HSTUError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TIME_BUCKETS = 32


class Runner:
    kernel = "triton"

    def __init__(self, sdpa: bool = True):
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if self.dev.type != "cuda" and not self.interpret:
            raise HSTUError(
                "hstu bench attention --backend torch needs a CUDA device, or TRITON_INTERPRET=1 "
                "set before starting to interpret the Triton kernel on a CPU"
            )
        from hstu_kernels.triton import hstu_attention
        from hstu_kernels.triton.reference import hstu_attention_reference

        self.fn, self.reference = hstu_attention, hstu_attention_reference
        self.sdpa = sdpa
        self.eager: list[str] = []  # why a call could not be captured (`_capture`)
        self.device = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"

    # ------------------------------------------------------------------ inputs
    def inputs(self, case: Case, seed: int = 0):
        """(q, k, v, grad_out) leaves, seq_offsets and the kernel's keyword arguments."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        t, h, d = case.tokens, case.heads, case.dim
        dtype = DTYPES[case.dtype]

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(self.dev)

        q, k, v, do = (randn(t, h, d).to(dtype) for _ in range(4))
        lengths = torch.tensor(case.lengths, dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(self.dev)
        kw = dict(max_seqlen=case.seqlen, alpha=1.0 / d**0.5, normalizer=float(case.seqlen))
        if case.rab:
            kw["rab_pos"] = randn(h, case.seqlen, scale=0.1)
            kw["rab_time"] = randn(h, TIME_BUCKETS, scale=0.1)
            gaps = torch.randint(0, 3600, (t,), generator=g)
            kw["timestamps"] = gaps.cumsum(0).to(self.dev)
        return [q, k, v], do, offsets, kw

    @staticmethod
    def _tables(kw) -> list[torch.Tensor]:
        return [kw[name] for name in ("rab_pos", "rab_time") if name in kw]

    # ------------------------------------------------------------------ check
    def check(self, case: Case) -> dict[str, float]:
        """max |kernel - reference| / max |reference| of the output and every gradient."""
        leaves, do, offsets, kw = self.inputs(case, seed=1)
        results = []
        for fn, upcast in ((self.fn, False), (self.reference, True)):
            xs = [(x.float() if upcast else x).detach().requires_grad_() for x in leaves]
            kws = dict(kw)
            tables = [kws[n].detach().requires_grad_() for n in ("rab_pos", "rab_time") if n in kws]
            for name, table in zip(("rab_pos", "rab_time"), tables):
                kws[name] = table
            out = fn(*xs, offsets, **kws)
            grads = torch.autograd.grad(out, xs + tables, do.to(out.dtype))
            results.append([out, *grads])
        names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in ("rab_pos", "rab_time") if n in kw]
        errors = {}
        for name, got, want in zip(names, *results):
            scale = want.abs().max().item()
            diff = (got.float() - want.float()).abs().max().item()
            errors[name] = diff / scale if scale > 0 else diff
        return errors

    # ------------------------------------------------------------------ timing
    def _ms(self, fn, warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        if self.dev.type != "cuda":
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        graph = self._capture(fn)
        call = graph.replay if graph is not None else fn
        torch.cuda.synchronize(self.dev)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph  # its memory pool, before the next case
        return statistics.median(times)

    def _capture(self, fn):
        """`fn` (forward, or forward and autograd backward) captured in a CUDA graph, so that
        the events time the device: an eager call of a small case times the host instead (the
        op's Python wrapper, autograd, the launches: ~0.2 ms forward, ~0.8 ms with backward on
        the H200's host, more than the kernels up to ~16K tokens). The training step replays
        the attention from graphs too (`train.cuda_graphs`). None if `fn` cannot be captured:
        then the eager call is timed and the runner says so (`self.eager`)."""
        torch.cuda.synchronize(self.dev)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as err:
            self.eager.append(str(err).splitlines()[0][:120])
            torch.cuda.synchronize(self.dev)
            return None
        return graph

    def _time_pair(self, fwd, fwd_bwd, warmup, repeats) -> tuple[float, float, str]:
        seen = len(self.eager)
        try:
            times = self._ms(fwd, warmup, repeats), self._ms(fwd_bwd, warmup, repeats)
            return *times, (f"timed eager: {self.eager[-1]}" if len(self.eager) > seen else "")
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return float("nan"), float("nan"), "out of memory"

    def time(self, case: Case, warmup: int, repeats: int) -> tuple[float, float, str]:
        leaves, do, offsets, kw = self.inputs(case)
        xs = [x.requires_grad_() for x in leaves]
        tables = [t.requires_grad_() for t in self._tables(kw)]

        def fwd():
            with torch.no_grad():
                return self.fn(*xs, offsets, **kw)

        def fwd_bwd():
            return torch.autograd.grad(self.fn(*xs, offsets, **kw), xs + tables, do)

        return self._time_pair(fwd, fwd_bwd, warmup, repeats)

    def extra_kernels(self, case: Case) -> list[str]:
        return ["sdpa"] if self.sdpa and case.layout == "equal" and not case.rab else []

    def time_extra(self, name: str, case: Case, warmup: int, repeats: int):
        """SDPA, causal softmax attention over `[B, H, S, D]` (the same unmasked pairs)."""
        assert name == "sdpa"
        dtype = DTYPES[case.dtype]
        shape = (case.batch, case.heads, case.seqlen, case.dim)
        q, k, v, do = (torch.randn(shape, device=self.dev, dtype=dtype) for _ in range(4))
        xs = [x.requires_grad_() for x in (q, k, v)]

        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(*xs, is_causal=True)

        def fwd_bwd():
            out = F.scaled_dot_product_attention(*xs, is_causal=True)
            return torch.autograd.grad(out, xs, do)

        return self._time_pair(fwd, fwd_bwd, warmup, repeats)
