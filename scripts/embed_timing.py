"""What the step graph's embedding input costs on the device, forward and backward, in the
ways it can be written: the small tables' lookup alone, then the whole layer input.

    python scripts/embed_timing.py [--capacity 12288] [--rows 32] [--items 5000]

The step graph (hstu/torch_backend/step_graphs.py) reads the contextual and action tables as
one `[C + A, D]` fp32 table at every position of the token capacity: contextual and action
tokens at their rows, every other position at row 0 with a zero gradient (masked after).
Variants, each forward + backward of `where(mask, lookup(ids, table).to(bf16), 0)`:

* `embedding int64`: `F.embedding` with int64 ids (as the step graph does): its backward sorts
  the ids (CUB radix sort) and sums the gradient by segments;
* `embedding int32`: the same with int32 ids (the sort's keys half as wide);
* `index_select`: `index_select`, whose backward adds every row atomically (`index_add`).

Then the whole input, from the item rows and the small tables to the stack's bf16 rows in
token order: the torch ops (`embed_tokens_reference`: a gather, two casts, a select and the
permutation each way) against `hstu_kernels.triton.embed_tokens` (one kernel each way), and
that with the small tables' gradient summed over the sources' runs (`segments`, as the step
graph calls it) instead of torch's sorted embedding backward.

bench_upstream at batch 32 has ~12K tokens a step, 4 contextual tokens a sample and ~5K
events (action tokens). Times: CUDA-graph replays (`hstu_kernels.triton.bench.graph_time_ms`),
device ms per call. Prints two tables.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=12288)
    p.add_argument("--rows", type=int, default=32, help="samples (4 contextual tokens each)")
    p.add_argument("--items", type=int, default=5000, help="events: action tokens")
    p.add_argument("--contextual-ids", type=int, default=1000)
    p.add_argument("--actions", type=int, default=16)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    from hstu_kernels.triton.bench import graph_time_ms

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n_ctx, n_act, cap = 4 * args.rows, args.items, args.capacity
    table = torch.randn(args.contextual_ids + args.actions, args.dim, device=dev)
    table.requires_grad_()
    ids = torch.zeros(cap, dtype=torch.int64, device=dev)
    ids[:n_ctx] = torch.randint(0, args.contextual_ids, (n_ctx,), device=dev, generator=gen)
    acts = torch.randint(0, args.actions, (n_act,), device=dev, generator=gen)
    ids[n_ctx : n_ctx + n_act] = args.contextual_ids + acts
    perm = torch.randperm(cap, device=dev, generator=gen)  # the tokens' order: interleaved
    ids = ids[perm]
    mask = (perm < n_ctx + n_act)[:, None]
    grad = torch.randn(cap, args.dim, device=dev, generator=gen).to(torch.bfloat16)
    ids32 = ids.to(torch.int32)
    variants = {
        "embedding int64": lambda: F.embedding(ids, table),
        "embedding int32": lambda: F.embedding(ids32, table),
        "index_select": lambda: table.index_select(0, ids),
    }
    want = None
    print(f"{'variant':<18} {'fwd+bwd ms':>10}  table gradient")
    for name, lookup in variants.items():

        def step(lookup=lookup):
            e = torch.where(mask, lookup().to(torch.bfloat16), 0)
            (g,) = torch.autograd.grad(e, table, grad)
            return g

        got = step()
        want = got if want is None else want
        same = "same bits" if torch.equal(got, want) else f"max diff {(got - want).abs().max():.2e}"
        print(f"{name:<18} {graph_time_ms(step, args.calls, args.rounds):10.4f}  {same}")

    from hstu_kernels.triton.embed_tokens import embed_tokens, embed_tokens_reference

    # the layer input as the step graph lays it out: sources in runs (contextual, items,
    # actions: the items' sources are the table rows), the tokens' order interleaving them
    src_ids = torch.argsort(perm)  # source s is the lookup at position perm^-1 above
    src_ids = ids[src_ids].to(torch.int32)
    flags = torch.arange(cap, device=dev) < n_ctx + n_act
    bounds = torch.tensor([0, n_ctx, n_ctx, n_ctx + n_act], device=dev)
    runs = (bounds, (args.contextual_ids, args.actions))
    rows = torch.randn(cap, args.dim, device=dev, generator=gen).requires_grad_()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(cap, device=dev)
    print(f"\n{'layer input':<18} {'fwd+bwd ms':>10}  x and both gradients")
    want = None
    variants = (
        ("torch ops", embed_tokens_reference, {}),
        ("embed_tokens", embed_tokens, {}),
        ("... by runs", embed_tokens, {"segments": runs}),
    )
    for name, fn, kw in variants:

        def whole(fn=fn, kw=kw):
            x = fn(rows, table, src_ids, flags, perm, inv, torch.bfloat16, **kw)
            # x detached: a result holding its graph keeps autograd's nodes of the leaves
            # alive into the next capture, whose backward then waits on the legacy stream
            return x.detach(), *torch.autograd.grad(x, (rows, table), grad)

        got = whole()
        want = got if want is None else want
        same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        diff = (got[2] - want[2]).abs().max().item()  # the small tables' sums: another order
        note = "same bits" if same else f"table gradient max diff {diff:.2e}"
        if not all(torch.equal(g, w) for g, w in zip(got[:2], want[:2], strict=True)):
            note = "DIFFERENT"
        ms = graph_time_ms(whole, args.calls, args.rounds)
        print(f"{name:<18} {ms:10.4f}  {note}")


if __name__ == "__main__":
    main()
