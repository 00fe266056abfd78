"""Token capacities for static-shape steps: few programs, little padding, by design.

A static-shape backend (JAX; torch with CUDA graphs) pads every rank's tokens to a capacity T
and builds one program per distinct T. Powers of two keep programs few but waste up to half the
compute on padding; one capacity per batch wastes nothing but compiles every step. The policy
here fixes the capacities from the config before training:

* it draws `num_draws` global batches' sample lengths from the data config's distribution (the
  same generator the data uses, lengths only), splits each as the configured shuffler would
  (identity, or the balancer's plan), and records the largest rank's token count of each;
* the capacities are the `num_buckets - 1` values (aligned) that minimise the mean relative
  padding of those counts, each padded to the smallest capacity holding it (1-D optimal
  bucketing, by dynamic programming); the largest draw is one of them;
* a batch beyond every draw (rare: about one step in `num_draws`) gets a capacity `ratio` above
  the largest, the last of the `num_buckets` programs in practice, and every batch fits.

`capacity(n)` is the smallest capacity holding `n`. The expected padding falls as buckets are
added (`hstu bench e2e` reports it as `padding_waste`); each bucket is one more program. How
many: `train.capacity_buckets`, or, at 0, the backend's own (`BACKEND_BUCKETS`): a JAX program
is a compile of seconds and issue 13 bounds a run at 8, a torch CUDA graph a capture of ~0.2 s
(48: 1.9 % padding at `bench_upstream`'s batch 32 against 3.0 % with 32 and 12.5 % with 8;
32 against 8 +4 % TFLOP/s on an H200, 48 against 32 +0.5 %, docs/BENCHMARKS.md). Packed
batches (`data.pack_window`, built before a backend is chosen) fill `NEUTRAL_BUCKETS`
capacities in both, padding ~1.4 % with them.

A prepared dataset draws its samples' sizes from the dataset itself (`from_prepared`); other
sources, whose lengths nothing describes, use geometric buckets (`ratio`). `for_source` picks
among the three.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass

import numpy as np

from hstu.errors import HSTUError

ALIGN = 256  # capacities are multiples of this (kernel tiles, and fewer distinct shapes)
# `train.capacity_buckets=0`: the buckets of each backend, and of callers that name none
BACKEND_BUCKETS = {"jax": 8, "torch": 48}
NEUTRAL_BUCKETS = 8


@dataclass(frozen=True)
class CapacityPolicy:
    capacities: tuple[int, ...]  # sorted; the last holds any batch
    ratio: float = 1.25  # growth past the last capacity (a batch the config did not foresee)

    def capacity(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.capacities, int(num_tokens))
        if i < len(self.capacities):
            return self.capacities[i]
        size = self.capacities[-1] if self.capacities else ALIGN
        while size < num_tokens:
            size = align_up(size * self.ratio)
        return size

    def capacity_of(self, num_tokens: np.ndarray) -> np.ndarray:
        """`capacity` of every entry of an integer array (any shape), vectorised."""
        n = np.asarray(num_tokens, np.int64)
        caps = np.asarray(self.capacities or (ALIGN,), np.int64)
        i = np.searchsorted(caps, n)
        out = caps[np.minimum(i, len(caps) - 1)]
        grow = out < n  # past every capacity: the growth `capacity` applies
        while grow.any():
            out = np.where(grow, _align_all(np.ceil(out * self.ratio)), out)
            grow = out < n
        return out


def align_up(n: float, align: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `align` (at least one): the smallest capacity that could
    hold `n` tokens."""
    return max(align, int(-(-int(np.ceil(n)) // align) * align))


def geometric(maximum: int, minimum: int = ALIGN, ratio: float = 1.25) -> CapacityPolicy:
    """Capacities `minimum * ratio^k` up to `maximum` (a source of unknown lengths)."""
    caps, size = [], align_up(minimum)
    while size < maximum:
        caps.append(size)
        size = align_up(size * ratio)
    caps.append(align_up(maximum))
    return CapacityPolicy(tuple(caps), ratio)


def optimal_buckets(values: np.ndarray, k: int, align: int = ALIGN) -> tuple[int, ...]:
    """At most `k` capacities minimising the mean relative padding (capacity / value - 1) of
    `values`, each value padded to the smallest capacity holding it (optimal 1-D bucketing by
    dynamic programming over the sorted, aligned values; the largest is always a capacity)."""
    x = np.unique([align_up(v, align) for v in values])  # candidate capacities, sorted
    counts = np.array([np.sum(_align_all(values, align) == v) for v in x], np.float64)
    n = len(x)
    k = min(k, n)
    # cost(i, j): the relative padding (cap / x - 1, what `padding_waste` reports) of values
    # x[i..j], with their counts, all padded to x[j]
    cum_c = np.concatenate([[0.0], np.cumsum(counts)])
    cum_c_over_x = np.concatenate([[0.0], np.cumsum(counts / x)])

    def cost(i: int, j: int) -> float:
        return x[j] * (cum_c_over_x[j + 1] - cum_c_over_x[i]) - (cum_c[j + 1] - cum_c[i])

    best = np.full((k + 1, n), np.inf)
    back = np.zeros((k + 1, n), np.int64)
    for j in range(n):
        best[1, j] = cost(0, j)
    for b in range(2, k + 1):
        for j in range(n):
            for i in range(b - 1, j + 1):  # the last bucket holds x[i..j]
                c = best[b - 1, i - 1] + cost(i, j)
                if c < best[b, j]:
                    best[b, j], back[b, j] = c, i
    caps, j, b = [], n - 1, int(np.argmin(best[1:, n - 1])) + 1
    while b >= 1 and j >= 0:
        caps.append(int(x[j]))
        j, b = (back[b, j] - 1, b - 1) if b > 1 else (-1, 0)
    return tuple(sorted(caps))


def _align_all(values, align: int = ALIGN) -> np.ndarray:
    v = np.asarray(values, np.int64)
    return np.maximum(align, -(-v // align) * align)


def from_config(cfg, num_buckets: int = 8, num_draws: int = 1024, seed: int = 1) -> CapacityPolicy:
    """Capacities for the largest rank's tokens, drawn as the run will draw them: `num_buckets
    - 1` buckets chosen to minimise the expected padding, one left for a batch beyond every
    draw (the policy then grows by `ratio`; `batch_size * max_seqlen` always fits)."""
    from hstu.data.distributions import sample_lengths

    d = cfg.data

    def draw(rng, n):
        hist = sample_lengths(
            d.seqlen_dist, rng, n, d.min_history, d.max_history, **d.seqlen_params
        )
        return hist, rng.integers(d.min_candidates, d.max_candidates + 1, size=n)

    return _fitted(cfg, draw, d.num_contextual, num_buckets, num_draws, seed)


def from_prepared(
    cfg, dataset, num_buckets: int = 8, num_draws: int = 1024, seed: int = 1
) -> CapacityPolicy:
    """`from_config` for a prepared dataset (`hstu.data.prepared.PreparedDataset`): each
    global batch is `W * B` samples drawn from the dataset's own sizes (an epoch's order is a
    uniform permutation, so a batch is a uniform draw without replacement)."""
    hist_all, cand_all = dataset.sample_sizes()
    if len(hist_all) == 0:
        return geometric(cfg.data.batch_size * cfg.data.max_seqlen)

    def draw(rng, n):
        pick = rng.choice(len(hist_all), size=n, replace=n > len(hist_all))
        return hist_all[pick], cand_all[pick]

    return _fitted(cfg, draw, dataset.num_contextual, num_buckets, num_draws, seed)


def _fitted(cfg, draw, num_contextual, num_buckets, num_draws, seed) -> CapacityPolicy:
    """Fit the buckets to `num_draws` global batches of `draw(rng, W * B) -> (history
    events, candidates)` per sample, split as the configured shuffler splits them."""
    from hstu.shuffle_plan import identity_plan, make_plan
    from hstu.workload import HSTUCost

    if num_buckets < 2:
        raise HSTUError(f"capacity policy: num_buckets must be >= 2, got {num_buckets}")
    d, w = cfg.data, cfg.dist.world_size
    n = d.batch_size * w
    rng = np.random.default_rng([seed, d.seed])
    cost = HSTUCost.from_model_config(cfg.model)
    balanced = cfg.balance.shuffler == "balanced" and w > 1
    real = np.ones(n, bool)
    maxima = np.empty(num_draws, np.int64)
    for t in range(num_draws):
        hist, cand = draw(rng, n)
        tokens = num_contextual + 2 * hist + cand
        if balanced:
            flops = cost.flops(tokens, num_contextual, cand)
            plan = make_plan(flops, real, w, cfg.balance.method)
        else:
            plan = identity_plan(real, w)
        maxima[t] = tokens[plan.indices].sum(axis=1).max()
    return CapacityPolicy(optimal_buckets(maxima, num_buckets - 1))


def bucket_count(cfg, backend: str | None = None) -> int:
    """`train.capacity_buckets`, or at 0 `backend`'s own (`NEUTRAL_BUCKETS` for None)."""
    if cfg.train.capacity_buckets:
        return cfg.train.capacity_buckets
    if backend is None:
        return NEUTRAL_BUCKETS
    if backend not in BACKEND_BUCKETS:
        raise HSTUError(f"capacity policy: unknown backend {backend!r} (torch or jax)")
    return BACKEND_BUCKETS[backend]


def for_source(cfg, source=None, backend: str | None = None) -> CapacityPolicy:
    """The policy for the samples a run reads: `bucket_count(cfg, backend)` capacities drawn
    from the config when they are the config's synthetic samples, from the dataset when they
    are a prepared dataset (either also behind wrappers that keep the original as `.inner`),
    geometric buckets up to the largest possible batch otherwise. Packed samples
    (`data.pack_window`) fill the capacities they were packed to, unless the balancer
    re-partitions them (W > 1). `backend`: the one whose programs pad to these capacities
    (None: the data pipeline's, `block_policy`)."""
    from hstu.data.loader import find_source
    from hstu.data.packing import PackedSource
    from hstu.data.prepared import PreparedDataset
    from hstu.data.synthetic import SyntheticSamples

    packed = find_source(source, PackedSource)
    if packed is not None and not (cfg.balance.shuffler == "balanced" and cfg.dist.world_size > 1):
        return packed.policy
    buckets = bucket_count(cfg, backend)
    if source is None:
        return from_config(cfg, buckets)
    source = find_source(source, (SyntheticSamples, PreparedDataset))
    if source is None:
        return geometric(cfg.data.batch_size * cfg.data.max_seqlen)
    if isinstance(source, PreparedDataset):
        return from_prepared(cfg, source, buckets)
    return from_config(cfg, buckets)


def block_policy(cfg, source=None) -> CapacityPolicy:
    """The capacities of one rank's batch of `data.batch_size` samples split as identity splits
    it (what `data.pack_window` packs to, whatever the world size): `for_source` at W=1."""
    one = copy.deepcopy(cfg)
    one.dist.world_size, one.balance.shuffler = 1, "identity"
    return for_source(one, source)
