"""The loader: global batches by sample position, epochs, and resuming with another world."""

import numpy as np
import pytest

from hstu.data import DataLoader, batch_ranges, source_from_config
from hstu.errors import HSTUError


def _ids(batches):
    return [b.dense["sample_id"][: b.actual_batch_size].tolist() for b in batches]


def test_batches_are_consecutive_blocks_per_rank(demo_cfg):
    loader = DataLoader(source_from_config(demo_cfg), 3, 2, [0, 1])
    assert _ids(next(loader)) == [[0, 1, 2], [3, 4, 5]]
    assert _ids(next(loader)) == [[6, 7, 8], [9, 10, 11]]
    assert loader.position == 12
    one_rank = DataLoader(source_from_config(demo_cfg), 3, 2, [1], position=6)
    assert _ids(next(one_rank)) == [[9, 10, 11]]


def test_an_epoch_ends_the_global_batch_early_and_pads_it():
    ranges, nxt = batch_ranges(8, 3, 2, num_samples=10)
    assert ranges == [(8, 10), (10, 10)] and nxt == 10  # rank 1 gets no real sample
    ranges, nxt = batch_ranges(10, 3, 2, num_samples=10)
    assert ranges == [(10, 13), (13, 16)] and nxt == 16  # epoch 1 starts at 10
    with pytest.raises(HSTUError, match="position"):
        batch_ranges(-1, 3, 2, 0)


def test_every_epoch_replays_the_same_samples(demo_cfg):
    demo_cfg.data.num_samples = 10
    loader = DataLoader(source_from_config(demo_cfg), 3, 2, [0, 1])
    epoch = [next(loader) for _ in range(2)]
    assert _ids(epoch[1]) == [[6, 7, 8], [9]] and epoch[1][1].batch_size == 3
    again = [next(loader) for _ in range(2)]
    for a, b in zip(epoch, again, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x == y


@pytest.mark.parametrize("new_world", [2, 8])
def test_resuming_with_another_world_size_continues_with_the_next_samples(demo_cfg, new_world):
    source = source_from_config(demo_cfg)
    first = DataLoader(source, 4, 4, range(4))
    seen = [i for _ in range(3) for ids in _ids(next(first)) for i in ids]
    second = DataLoader(source, 4, new_world, range(new_world), position=first.position)
    seen += [i for _ in range(3) for ids in _ids(next(second)) for i in ids]
    assert seen == list(range(len(seen)))  # nothing skipped, nothing repeated
    assert np.all(np.diff(seen) == 1)


class _BadAt:
    """A source whose sample `bad` is invalid (picklable: the workers unpickle it)."""

    def __init__(self, inner, bad: int):
        self.inner, self.bad, self.num_samples = inner, bad, inner.num_samples

    @property
    def jagged_keys(self):
        return self.inner.jagged_keys

    def sample(self, index: int) -> dict:
        if index == self.bad:
            raise HSTUError(f"sample {index} is broken")
        return self.inner.sample(index)


def test_worker_processes_yield_the_loaders_batches_in_order(demo_cfg):
    """`data.workers`: the same batches and positions as the in-process loader (epochs
    included), built in spawned processes; a worker's error surfaces from next()."""
    from hstu.data.workers import WorkerLoader

    demo_cfg.data.num_samples = 20
    source = source_from_config(demo_cfg)
    want = DataLoader(source, 3, 2, [0, 1], position=6)
    got = WorkerLoader(DataLoader(source, 3, 2, [0, 1], position=6), workers=2, ahead=3)
    try:
        for _ in range(6):
            expected, batches = next(want), next(got)
            assert got.position == want.position
            for x, y in zip(expected, batches, strict=True):
                assert x == y
    finally:
        got.close()
    broken = WorkerLoader(DataLoader(_BadAt(source, 4), 3, 1, [0]), workers=1)
    try:
        next(broken)  # samples 0-2
        with pytest.raises(HSTUError, match="sample 4 is broken"):
            next(broken)
    finally:
        broken.close()


def test_worker_processes_prepare_the_batches_as_the_host_would(demo_cfg):
    """With a `BatchPrep`, a worker returns the batches and their stats exactly as the host's
    prefetch thread computed them; a batch the model's input check rejects raises from next()
    with the host's message (before any collective of that batch)."""
    from hstu.batch import ModelInputCheck
    from hstu.data.workers import WorkerLoader
    from hstu.pipeline import BatchPrep
    from hstu.workload import HSTUCost

    cost = HSTUCost.from_model_config(demo_cfg.model)
    check = ModelInputCheck(demo_cfg.model, demo_cfg.data.max_seqlen)
    prep = BatchPrep((0, 1), cost, demo_cfg.model.task, True, check)
    source = source_from_config(demo_cfg)
    want = DataLoader(source, 3, 2, [0, 1])
    got = WorkerLoader(DataLoader(source, 3, 2, [0, 1]), workers=2, ahead=3, prepare=prep)
    try:
        for _ in range(4):
            expected = prep(next(want))
            batches, stats = next(got)
            assert np.array_equal(stats, expected[1]) and stats.dtype == np.int64
            for x, y in zip(expected[0], batches, strict=True):
                assert x == y
    finally:
        got.close()
    demo_cfg.model.num_items = 3  # every batch now holds item ids past the table
    strict = BatchPrep((0,), cost, "ranking", True, ModelInputCheck(demo_cfg.model, 10**6))
    broken = WorkerLoader(DataLoader(source, 3, 1, [0]), workers=1, prepare=strict)
    try:
        with pytest.raises(HSTUError, match="invalid batch on rank 0"):
            next(broken)
    finally:
        broken.close()


def test_a_worker_process_that_dies_is_named_by_next_instead_of_hanging(demo_cfg):
    """A worker killed from outside (the OOM killer's SIGKILL) fails the batches in flight:
    next() raises an HSTUError naming the signal, within seconds, instead of waiting for a
    result no process will deliver (before: until train.watchdog_s ended the run)."""
    import multiprocessing
    import os
    import signal
    import time

    from hstu.data.workers import WorkerLoader

    demo_cfg.data.num_samples = 60
    before = {p.pid for p in multiprocessing.active_children()}
    loader = WorkerLoader(DataLoader(source_from_config(demo_cfg), 3, 1, [0]), workers=2)
    try:
        assert _ids(next(loader)) == [[0, 1, 2]]
        workers = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert workers, "the loader's worker processes"
        os.kill(workers[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(HSTUError, match=r"data worker process ended abruptly .*exit code -9"):
            for _ in range(10):  # batches finished before the kill may still come back
                next(loader)
                time.sleep(0.2)
        assert time.monotonic() - t0 < 30
    finally:
        loader.close()
