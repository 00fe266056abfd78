"""What the end of a torch training step costs on the device: AdamW over the dense parameters,
the gradients' norm and the stack's bf16 weight copies, the ways they can be run.

    python scripts/adamw_timing.py [--config bench_upstream] [--tiles 2048x1,2048x8,...]

The parameters are those of the recipe's model but the embedding tables (42M at
`bench_upstream`), fp32, with random gradients and moments. Variants:

* `torch`: torch's fused AdamW (capturable, as the step graphs ran it), `_foreach_norm` of the
  gradients, and the multi-tensor copy of the stack's linears to bf16 (`reduced_weights`);
* `adamw_multi BxIxW`: `hstu_kernels.triton.adamw_multi.adamw_multi_` with `BLOCK = B`,
  `ITERS = I`, `WARPS = W` (elements per iteration, iterations per program, warps per
  program), the copies written by it.

Times: CUDA-graph replays (`hstu_kernels.triton.bench.graph_time_ms`), device ms per call,
each variant's parameters checked against torch's after one step first. Prints a table.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="bench_upstream")
    p.add_argument(
        "--tiles",
        default="2048x1x8,2048x8x8,1024x16x8,1024x8x8,1024x32x8,512x32x4,512x16x4,"
        "1024x16x4,2048x8x16,4096x4x16,2048x4x8",
        help="BLOCK x ITERS x warps, comma-separated",
    )
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    import hstu_kernels.triton.adamw_multi as am
    from hstu_kernels.triton.bench import graph_time_ms

    from hstu.config import load_config
    from hstu.params import param_shapes

    cfg = load_config(args.config)
    shapes = {n: s for n, s in param_shapes(cfg.model).items() if not n.startswith("embedding.")}
    stack = [n for n in shapes if n.startswith("layers.") and (".uvqk." in n or ".output." in n)]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def fresh():
        ps = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes.values()]
        gs = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes.values()]
        return ps, gs

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01)
    names = list(shapes)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"{len(names)} dense parameters, {numel / 1e6:.1f}M elements, {len(stack)} copied\n")

    ps, gs = fresh()
    m0 = [torch.randn(x.shape, device=dev, generator=gen) * 1e-4 for x in ps]
    v0 = [torch.rand(x.shape, device=dev, generator=gen) * 1e-6 for x in ps]
    t0 = 5.0
    params = [torch.nn.Parameter(x.clone()) for x in ps]
    for q, g in zip(params, gs, strict=True):
        q.grad = g
    opt = torch.optim.AdamW(
        params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], fused=True, capturable=True,
    )  # fmt: skip
    for q, m, v in zip(params, m0, v0, strict=True):
        opt.state[q] = {"step": torch.tensor(t0, device=dev), "exp_avg": m.clone(),
                        "exp_avg_sq": v.clone()}  # fmt: skip
    copied = [params[names.index(n)] for n in stack]
    copies = [torch.empty_like(x, dtype=torch.bfloat16) for x in copied]

    def torch_end():
        norm = torch.stack(torch._foreach_norm(gs)).square().sum()
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(copies, [x.detach() for x in copied])
        return norm

    torch_end()  # one step from (ps, m0, v0, t0): what each variant's first step must give
    want = [x.detach().clone() for x in params]
    results = [("torch", graph_time_ms(torch_end, args.calls, args.rounds), "reference")]

    for tile in args.tiles.split(","):
        block, iters, warps = (int(x) for x in tile.split("x"))
        am.BLOCK, am.ITERS, am.CHUNK, am.WARPS = block, iters, block * iters, warps
        mine = [x.clone() for x in ps]
        ms, vs = [x.clone() for x in m0], [x.clone() for x in v0]
        steps = [torch.full((1,), t0, device=dev) for _ in mine]
        cps = [torch.empty_like(mine[names.index(n)], dtype=torch.bfloat16) for n in stack]
        copy_of = {names.index(n): c for n, c in zip(stack, cps, strict=True)}
        out = [copy_of.get(i) for i in range(len(mine))]

        def multi(mine=mine, ms=ms, vs=vs, steps=steps, out=out):
            torch._foreach_add_(steps, 1)
            return am.adamw_multi_(mine, gs, ms, vs, steps, **hyper, copies=out)

        multi()
        diff = max(float((a - b).abs().max()) for a, b in zip(mine, want, strict=True))
        ms_ = graph_time_ms(multi, args.calls, args.rounds)
        results.append((f"adamw_multi {tile}", ms_, f"first step max |diff| {diff:.1e}"))

    print(f"{'variant':<22} {'ms':>8}  check")
    for name, ms_, note in results:
        print(f"{name:<22} {ms_:8.4f}  {note}")


if __name__ == "__main__":
    main()
