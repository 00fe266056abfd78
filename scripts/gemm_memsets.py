"""The bench_upstream layer's GEMMs in one CUDA graph, under cuBLAS workspace settings.

    python scripts/gemm_memsets.py [--tokens 10240] [--variants default lt0 cublas0 ...]

In the torch step's profile every GEMM with a bf16 output (the uvqk projection, the output
projection, both input gradients) follows a ~1 us memset node and starts 2-4 us after it; the
fp32-output weight gradients have none. This times the layer's six GEMMs as the step runs them
(`_ReducedAddmm`: `addmm` with the bias, `mm`, `dy @ w.T`, `mm(out_dtype=float32)` of `x.T`)
captured in one graph (`hstu_kernels.triton.bench.captured_graph`), each variant in a process
of its own (the settings are read when cuBLAS starts): the replay's device time (median of
`--repeats`), the graph's memset and kernel nodes, and the kernels cuBLAS picked. Variants
(environment of the child):

    default     as the trainer runs
    lt0         CUBLASLT_WORKSPACE_SIZE=0 (torch's cuBLASLt workspace, KiB)
    cublas0     CUBLAS_WORKSPACE_CONFIG=:0:0 (cuBLAS's own workspace)
    both0       both of the above
    lt          TORCH_BLAS_PREFER_CUBLASLT=1 (every GEMM through cuBLASLt)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = {
    "default": {},
    "lt0": {"CUBLASLT_WORKSPACE_SIZE": "0"},
    "cublas0": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"},
    "both0": {"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"},
    "lt": {"TORCH_BLAS_PREFER_CUBLASLT": "1"},
}


def _child(tokens: int, dim: int, wide: int, repeats: int) -> dict:
    import torch
    from hstu_kernels.triton.bench import captured_graph, replay_ms

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=bf, generator=g) * 0.05

    x, w_uvqk, b_uvqk = rand(tokens, dim), rand(dim, wide), rand(wide)
    y, w_out = rand(tokens, dim), rand(dim, dim)
    d_out, d_uvqk = rand(tokens, dim), rand(tokens, wide)

    def layer():
        torch.addmm(b_uvqk, x, w_uvqk)  # uvqk projection
        torch.mm(y, w_out)  # output projection (its bias added by the next norm)
        d_out @ w_out.t()  # output projection's input gradient
        torch.mm(y.t(), d_out, out_dtype=torch.float32)  # its weight gradient
        d_uvqk @ w_uvqk.t()  # uvqk's input gradient
        torch.mm(x.t(), d_uvqk, out_dtype=torch.float32)  # its weight gradient

    graph = captured_graph(layer)
    us = 1e3 * replay_ms(graph, repeats)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels, memsets = [], 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if "memset" in e.name.lower():
                memsets += 1
            else:
                kernels.append(f"{e.name[:60]} {e.device_time:.1f}")
    return {"us": us, "memsets": memsets, "kernels": kernels}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=10240)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--wide", type=int, default=4096, help="uvqk's output width")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.tokens, args.dim, args.wide, args.repeats)))
        return
    rows = []
    for rnd in range(2):  # two rounds, alternating: a drift of the machine falls on all
        for name in args.variants:
            env = {**os.environ, **VARIANTS[name]}
            cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens),
                   "--dim", str(args.dim), "--wide", str(args.wide),
                   "--repeats", str(args.repeats)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((rnd, name, r))
            if rnd == 0:
                print(f"== {name}: {r['memsets']} memsets; kernels (us):")
                for k in r["kernels"]:
                    print(f"     {k}")
    print(f"\n{'variant':<9} {'round':>5} {'graph us':>9} {'memsets':>8}")
    for rnd, name, r in rows:
        print(f"{name:<9} {rnd + 1:>5} {r['us']:9.1f} {r['memsets']:8d}")


if __name__ == "__main__":
    main()
