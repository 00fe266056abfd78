"""Token capacities fixed from the config: bounded programs, every batch fits, little padding."""

import numpy as np
import pytest

from hstu import capacity
from hstu.config import load_config
from hstu.data import DataLoader, source_from_config


def test_capacities_are_few_sorted_aligned_and_hold_any_batch(demo_cfg):
    policy = capacity.from_config(demo_cfg, num_buckets=8)
    caps = policy.capacities
    assert 1 <= len(caps) <= 8 and list(caps) == sorted(set(caps))
    assert all(c % capacity.ALIGN == 0 for c in caps)
    assert policy.capacity(1) == caps[0] and policy.capacity(caps[-1]) == caps[-1]
    most = demo_cfg.data.batch_size * demo_cfg.data.max_seqlen
    assert policy.capacity(most) >= most  # past every draw: grows, still fits


def test_optimal_buckets_minimise_padding_against_brute_force(rng):
    import itertools

    values = rng.integers(1, 12, size=40) * capacity.ALIGN
    best = capacity.optimal_buckets(values, 3)
    assert len(best) <= 3 and best[-1] == values.max()

    def padding(caps):  # relative, as `padding_waste` reports it
        return sum(min(c for c in caps if c >= v) / v - 1 for v in values)

    candidates = sorted(set(values.tolist()))
    brute = min(
        padding((*combo, values.max()))
        for r in range(0, 3)
        for combo in itertools.combinations(candidates[:-1], r)
    )
    assert padding(best) == pytest.approx(brute)


@pytest.mark.parametrize("shuffler", ["identity", "balanced"])
def test_upstream_recipe_pads_little_with_eight_programs(shuffler):
    """The buckets against the batches the run really draws and splits (W=2)."""
    from hstu.pipeline import STAT_REAL, STAT_TOKENS, STAT_WORKLOAD, sample_stats
    from hstu.shuffle_plan import identity_plan, make_plan
    from hstu.workload import HSTUCost

    cfg = load_config("bench_upstream", ["dist.world_size=2", f"balance.shuffler={shuffler}"])
    policy = capacity.from_config(cfg, num_buckets=8)
    cost = HSTUCost.from_model_config(cfg.model)
    loader = DataLoader(source_from_config(cfg), cfg.data.batch_size, 2, [0, 1])
    waste = []
    for _ in range(40):
        stats = sample_stats(next(loader), cost, "ranking")
        real = stats[:, STAT_REAL].astype(bool)
        plan = (
            make_plan(stats[:, STAT_WORKLOAD], real, 2)
            if shuffler == "balanced"
            else identity_plan(real, 2)
        )
        largest = int(stats[:, STAT_TOKENS][plan.indices].sum(axis=1).max())
        waste.append(policy.capacity(largest) / largest - 1)
    assert len(policy.capacities) <= 7  # the 8th program: a batch beyond every draw
    assert min(waste) >= 0 and np.mean(waste) < 0.15


def test_geometric_policy_for_unknown_lengths():
    policy = capacity.geometric(10_000, ratio=1.5)
    assert policy.capacities[-1] >= 10_000
    ratios = np.diff(policy.capacities) / np.array(policy.capacities[:-1])
    assert np.all(ratios <= 0.5 + capacity.ALIGN / policy.capacities[0])


def test_the_policy_follows_the_source(demo_cfg):
    from hstu.launch_checks import CheckedSource

    drawn = capacity.from_config(demo_cfg)
    assert capacity.for_source(demo_cfg, None) == drawn
    wrapped = CheckedSource(source_from_config(demo_cfg))
    assert capacity.for_source(demo_cfg, wrapped) == drawn  # seen through the wrapper

    class Other:
        num_samples, jagged_keys = 0, ()

    most = demo_cfg.data.batch_size * demo_cfg.data.max_seqlen
    assert capacity.for_source(demo_cfg, Other()) == capacity.geometric(most)


def test_capacity_buckets_set_how_many_capacities_a_run_pads_to():
    """`train.capacity_buckets`: the run's capacities (programs, graphs) for its source; more
    of them pad the bench_upstream batches less (the first 100 W=1 batch-32 steps: 12.3 %
    with 8, 6.0 % with 16; over 500, 12.5 % and 5.7 %); outside 0 and 2..48 the config names
    the key."""
    from hstu.errors import HSTUError

    pads, tokens = {}, None
    for buckets in (8, 16):
        cfg = load_config(
            "bench_upstream", ["dist.world_size=1", f"train.capacity_buckets={buckets}"]
        )
        policy = capacity.for_source(cfg, source_from_config(cfg))
        assert policy == capacity.from_config(cfg, num_buckets=buckets)
        assert len(policy.capacities) <= buckets - 1  # one left for a batch beyond every draw
        if tokens is None:  # the batches depend on the data config only
            loader = DataLoader(source_from_config(cfg), cfg.data.batch_size, 1, [0])
            tokens = np.array([next(loader)[0].num_real_tokens() for _ in range(100)])
        pads[buckets] = np.mean([policy.capacity(int(t)) / t - 1 for t in tokens])
    assert 0.10 < pads[8] < 0.15 and pads[16] < 0.065
    for bad in (-1, 1, 49):
        with pytest.raises(HSTUError, match="train.capacity_buckets"):
            load_config("demo", [f"train.capacity_buckets={bad}"])


def test_capacity_buckets_zero_is_each_backends_own():
    """`train.capacity_buckets=0` (the default): 48 capacities for torch's graphs, 8 for jax's
    compiled programs and for callers naming no backend (packing); a value set applies to
    both. torch's 48 pad the bench_upstream batches about a sixth as much (the first 100
    W=1 batch-32 steps: ~2 % against 12 %)."""
    from hstu.errors import HSTUError

    cfg = load_config("bench_upstream", ["dist.world_size=1"])
    assert cfg.train.capacity_buckets == 0
    source = source_from_config(cfg)
    torch_policy = capacity.for_source(cfg, source, "torch")
    assert torch_policy == capacity.from_config(cfg, num_buckets=48)
    for backend in ("jax", None):
        assert capacity.for_source(cfg, source, backend) == capacity.from_config(cfg)
    loader = DataLoader(source, cfg.data.batch_size, 1, [0])
    tokens = np.array([next(loader)[0].num_real_tokens() for _ in range(100)])
    pads = {
        name: np.mean([policy.capacity(int(t)) / t - 1 for t in tokens])
        for name, policy in (("torch", torch_policy), ("jax", capacity.from_config(cfg)))
    }
    assert pads["torch"] < 0.025 and pads["jax"] > 0.10
    cfg.train.capacity_buckets = 12  # set: the same for both backends
    assert capacity.bucket_count(cfg, "torch") == capacity.bucket_count(cfg, "jax") == 12
    cfg.train.capacity_buckets = 0
    with pytest.raises(HSTUError, match="unknown backend 'mx'"):
        capacity.bucket_count(cfg, "mx")
