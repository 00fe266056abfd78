"""What the AdamW update costs on the device, JAX (optax) against torch (fused), per recipe.

    python scripts/optimizer_timing.py [--config bench_upstream] [--repeats 20]

Both on the recipe's parameters (`hstu.params.param_shapes`), fp32, random gradients. JAX:
`optax.adamw` as the backend builds it (`make_optimizer`), jitted with params and state
donated, as inside the train step; the same with the small leaves (all but the largest)
concatenated into one vector (`optax.flatten` on those leaves), and the update of the
largest leaf alone. torch: `torch.optim.AdamW(fused=True)`. Each variant: back-to-back calls,
one wait, time per call (median of repeats). Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _jax_rows(cfg, repeats: int) -> list[tuple[str, float]]:
    import jax
    import jax.numpy as jnp
    import optax

    from hstu.jax_backend.state import make_optimizer
    from hstu.params import param_shapes

    shapes = param_shapes(cfg.model)
    big = max(shapes, key=lambda k: int(np.prod(shapes[k])))
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}
    grads = {k: jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}
    tc = cfg.train
    adamw = make_optimizer(tc)

    def grouped(inner):  # the largest leaf on its own, every other leaf in one flat vector
        labels = {k: "big" if k == big else "small" for k in shapes}
        return optax.multi_transform({"big": inner, "small": optax.flatten(inner)}, labels)

    variants = {
        "optax.adamw, every leaf": (adamw, params, grads),
        "small leaves flattened": (grouped(adamw), params, grads),
        f"largest leaf alone ({big})": (adamw, {big: params[big]}, {big: grads[big]}),
        "every leaf but the largest": (
            adamw,
            {k: v for k, v in params.items() if k != big},
            {k: v for k, v in grads.items() if k != big},
        ),
    }
    rows = []
    for name, (opt, p, g) in variants.items():

        def step(p, s, g, opt=opt):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        fn = jax.jit(step, donate_argnums=(0, 1))
        p = jax.tree.map(jnp.copy, p)
        s = opt.init(p)
        p, s = fn(p, s, g)
        jax.block_until_ready(p)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(5):
                p, s = fn(p, s, g)
            jax.block_until_ready(p)
            times.append((time.perf_counter() - t0) / 5)
        rows.append((f"jax: {name}", statistics.median(times)))
    return rows


def _torch_rows(cfg, repeats: int) -> list[tuple[str, float]]:
    import torch

    from hstu.params import param_shapes

    if not torch.cuda.is_available():
        return []
    tc = cfg.train
    shapes = param_shapes(cfg.model)
    params = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes.values()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(
        params, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
        weight_decay=tc.weight_decay, fused=True,
    )  # fmt: skip
    opt.step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 5)
    return [("torch: AdamW(fused=True), every leaf", statistics.median(times))]


def main(argv=None) -> None:
    from hstu.config import load_config
    from hstu.params import param_shapes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench_upstream")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backends", default="jax,torch")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    shapes = param_shapes(cfg.model)
    total = sum(int(np.prod(s)) for s in shapes.values())
    print(f"{args.config}: {len(shapes)} leaves, {total / 1e6:.1f}M parameters (fp32)")
    rows = []
    if "jax" in args.backends:
        rows += _jax_rows(cfg, args.repeats)
    if "torch" in args.backends:
        rows += _torch_rows(cfg, args.repeats)
    for name, sec in rows:
        print(f"{name:<60} {1e3 * sec:8.3f} ms")


if __name__ == "__main__":
    main()
