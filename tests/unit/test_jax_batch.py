"""JAX batch pytree: lossless JaggedBatch round trips, capacities, exchange host tables."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hstu.batch import JaggedBatch, empty_like  # noqa: E402
from hstu.config import load_config  # noqa: E402
from hstu.data.synthetic import dataset_from_config  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.jax_backend import batch as jb  # noqa: E402
from hstu.jax_backend import collectives as col  # noqa: E402
from hstu.jax_backend.shuffler import JaxShuffler, plan_exchange  # noqa: E402
from hstu.pipeline import STAT_LOSS_TOKENS, sample_stats  # noqa: E402
from hstu.shuffle_plan import identity_plan, make_plan  # noqa: E402
from hstu.workload import HSTUCost  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    return col.make_mesh(jax.devices()[:1])


def _batches(task="ranking", num_samples=0, index=0, world=1):
    cfg = load_config(
        "configs/demo.yaml", [f"model.task={task}", f"data.num_samples={num_samples}"]
    )
    return dataset_from_config(cfg, world, 0).global_batch(index)


def _with_dense(b: JaggedBatch) -> JaggedBatch:
    """Extra dense fields: float32 (bit-exact), 2-D int, bool."""
    out = b.clone()
    real = np.arange(b.batch_size) < b.actual_batch_size
    rng = np.random.default_rng(0)
    out.dense["score"] = np.where(real, rng.normal(size=b.batch_size), 0).astype(np.float32)
    out.dense["pair"] = (rng.integers(-5, 5, (b.batch_size, 2)) * real[:, None]).astype(np.int64)
    out.dense["flag"] = real & (rng.random(b.batch_size) < 0.5)
    return out.validate()


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_round_trip_lossless(mesh, task):
    full = _batches(task)[0]
    incomplete = _batches(task, num_samples=5)[0]  # 5 real of 8
    for host in (full, incomplete, _with_dense(incomplete), empty_like(full)):
        dev = jb.to_device([host], col.rank_sharding(mesh))
        back = jb.to_jagged(dev)
        assert len(back) == 1 and back[0].diff(host) == []
        leaves, treedef = jax.tree_util.tree_flatten(dev)
        again = jax.tree_util.tree_unflatten(treedef, leaves)  # a pytree with static spec
        assert again.spec == dev.spec and jb.to_jagged(again)[0].diff(host) == []


def test_one_transfer_per_batch(mesh):
    """A batch goes to the device as one int32 row per rank, its leaves at disjoint offsets
    that tile the row; read inside a jitted program or eagerly, they are the host leaves."""
    host = _with_dense(_batches(num_samples=5)[0])
    dev = jb.to_device([host], col.rank_sharding(mesh))
    assert isinstance(dev, jb.PackedBatch) and len(jax.tree.leaves(dev)) == 1
    width = jb.packed_width(dev.spec)
    assert dev.buffer.shape == (1, width) and dev.buffer.dtype == np.int32
    covered = np.zeros(width, int)
    for _, _, off, shape in jb.packed_layout(dev.spec):
        covered[off : off + int(np.prod(shape))] += 1
    assert (covered == 1).all()
    want = jb.host_arrays([host], dev.spec)
    assert want["dense"]["score"].dtype == np.int32  # float32 rides bit for bit

    def leaves(b):
        u = jb.local_view(b).unpack()
        return {"lengths": u.lengths, "values": u.values, "dense": u.dense, "num": u.num_real}

    for got in (jax.jit(leaves)(dev), leaves(dev)):
        for field in ("lengths", "values", "dense"):
            assert got[field].keys() == want[field].keys()
            for key, x in want[field].items():
                np.testing.assert_array_equal(np.asarray(got[field][key]), x[0], err_msg=key)
        assert int(got["num"]) == host.actual_batch_size == 5
    np.testing.assert_array_equal(np.asarray(dev.lengths["item"])[0], host.lengths["item"])


def test_dense_shape_is_checked(mesh):
    host = _with_dense(_batches()[0])
    spec = jb.spec_from_batches([host])
    host.dense["pair"] = np.zeros((host.batch_size, 3), np.int64)
    with pytest.raises(HSTUError, match=r"dense\['pair'\].*\(8, 3\).*\(8, 2\)"):
        jb.to_device([host], col.rank_sharding(mesh), spec)


def test_values_past_lengths_are_zero(mesh):
    host = _batches()[0]
    dev = jb.to_device([host], col.rank_sharding(mesh))
    for key in host.keys:
        vals = np.asarray(dev.values[key])[0]
        assert not vals[host.lengths[key].sum() :].any()


def test_int32_range_is_checked(mesh):
    host = _batches()[0].clone()
    host.values["item_time"][0] = 2**40
    with pytest.raises(HSTUError, match="item_time.*int32"):
        jb.to_device([host], col.rank_sharding(mesh))


def test_bucket_capacity():
    assert [jb.bucket_capacity(n) for n in (0, 1, 128, 129, 256, 257, 1000)] == [
        128,
        128,
        128,
        256,
        256,
        512,
        1024,
    ]
    assert [jb.bucket_capacity(n, fine=True) for n in (129, 193, 257, 385)] == [192, 256, 384, 512]
    for n in range(0, 5000, 37):
        c = jb.bucket_capacity(n)
        assert c >= n and (c == 128 or c < 2 * n)


def test_spec_capacities_derive_from_tokens():
    hosts = _batches(world=4)
    spec = jb.spec_from_batches(hosts)
    tokens = max(b.num_real_tokens() for b in hosts)
    assert spec.token_capacity == jb.bucket_capacity(tokens)
    assert spec.capacity("item") == spec.token_capacity // 2
    assert spec.capacity("label") == spec.token_capacity
    for key in spec.keys:
        assert spec.capacity(key) >= max(int(b.lengths[key].sum()) for b in hosts)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_a_capacity_names_its_batch_shapes(task):
    """`spec_at_capacity`: the spec any batch of the same keys at token capacity T gets from
    its lengths, known from T alone (the programs built ahead take it): for each global
    batch, the spec of another batch moved to this one's capacity is this one's spec."""
    from hstu.capacity import CapacityPolicy

    policy = CapacityPolicy((256, 512, 768, 1024, 1536))
    specs = []
    for index in range(6):
        hosts = _batches(task, world=2, index=index)
        lengths = {k: np.stack([b.lengths[k] for b in hosts]) for k in hosts[0].keys}
        specs.append(jb.spec_for_lengths(jb.spec_from_batches(hosts), lengths, policy.capacity))
    assert len({s.token_capacity for s in specs}) >= 2  # the draws span capacities
    for spec in specs:
        for other in specs:
            assert jb.spec_at_capacity(other, spec.token_capacity) == spec
    # a key whose capacity does not follow from T (negatives with no R to scale): no spec
    if task == "retrieval":
        odd = specs[0].with_capacities(
            [c + 1 if k == "negative" else c for k, c in zip(specs[0].keys, specs[0].capacities)],
            specs[0].token_capacity,
        )
        assert jb.spec_at_capacity(odd, 512) is None


def test_candidate_keys_bounded_by_samples_times_max_candidates(mesh):
    """Ranking's candidate keys hold at most B * K values per rank (K = `data.max_candidates`),
    as torch's step graphs bound the loss rows: their capacity is `min(T, B K)` at every T,
    known from T alone; a batch past the bound gets a capacity of its own and loses nothing."""
    from hstu.capacity import CapacityPolicy

    cfg = load_config("configs/demo.yaml")
    k = jb.candidate_bound(cfg)
    assert k == cfg.data.max_candidates == 4
    assert jb.candidate_bound(load_config("configs/demo.yaml", ["model.task=retrieval"])) == 0
    policy = CapacityPolicy((256, 512, 768, 1024, 1536))
    specs = []
    for index in range(4):
        hosts = _batches(world=2, index=index)
        lengths = {key: np.stack([b.lengths[key] for b in hosts]) for key in hosts[0].keys}
        spec = jb.spec_for(hosts[0], lengths, policy.capacity, candidates_per_sample=k)
        unbounded = jb.spec_for(hosts[0], lengths, policy.capacity)
        bound = min(spec.token_capacity, spec.batch_size * k)
        assert bound == 32 < spec.token_capacity  # demo: 8 samples of at most 4 candidates
        for key in ("candidate", "candidate_time", "label"):
            if key in spec.keys:
                assert spec.capacity(key) == bound
                assert unbounded.capacity(key) == spec.token_capacity
        for key in ("item", "action", "contextual"):
            assert spec.capacity(key) == unbounded.capacity(key)
        specs.append(spec)
        dev = jb.to_device(hosts[:1], col.rank_sharding(mesh), spec)
        assert jb.to_jagged(dev)[0].diff(hosts[0]) == []
    for spec in specs:
        for other in specs:
            assert jb.spec_at_capacity(other, spec.token_capacity) == spec
    # a source past the bound (more candidates than K per sample): a capacity of their own
    hosts = _batches(index=0)
    lengths = {key: np.stack([b.lengths[key] for b in hosts]) for key in hosts[0].keys}
    need = int(lengths["candidate"].sum())
    assert need > 8  # some sample has more than one candidate
    tight = jb.spec_for(hosts[0], lengths, policy.capacity, candidates_per_sample=1)
    assert tight.capacity("candidate") == jb.bucket_capacity(need) >= need
    dev = jb.to_device(hosts, col.rank_sharding(mesh), tight)
    assert jb.to_jagged(dev)[0].diff(hosts[0]) == []


def test_stats_gather_is_exact_int64(mesh):
    stats = np.array([[2**40 + 3, -7, 0], [1, 2**62, -(2**50)]], dtype=np.int64)
    assert np.array_equal(col.allgather_stats(mesh, stats), stats)


@pytest.mark.parametrize("kind", ["allgather", "all2all"])
def test_single_rank_exchange_is_identity(mesh, kind):
    host = _batches(num_samples=6)
    shuffler = JaxShuffler(mesh, kind)
    placed = shuffler.ensure(shuffler.to_device(host))
    plan = identity_plan(np.arange(8) < 6, 1)
    out = shuffler.exchange(placed, plan, None)
    assert jb.to_jagged(out.batch)[0].diff(host[0]) == []
    assert out.token_capacity == placed.token_capacity


def test_all2all_tables_move_only_real_samples():
    hosts = _batches(world=4, num_samples=52, index=1)  # ranks hold 8, 8, 4, 0 real samples
    stats_lengths = {k: np.concatenate([b.lengths[k] for b in hosts]) for k in hosts[0].keys}
    tokens = np.concatenate([b.seq_lengths() for b in hosts])
    real = np.concatenate([np.arange(8) < b.actual_batch_size for b in hosts])
    plan = make_plan(tokens, real, 4)
    spec = jb.spec_from_batches(hosts)
    xspec, tables = plan_exchange(plan, stats_lengths, spec, "all2all")
    counts = plan.send_counts()
    sent = (tables["send_rows"] < 8).sum(axis=2)
    assert np.array_equal(sent, counts - np.diag(np.diag(counts)))
    assert xspec.num_rows >= sent.max()
    w, r, b = 4, xspec.num_rows, 8
    for d in range(4):  # every real output row comes from a chunk or the own batch
        rows = tables["recv_rows"][d]
        assert (rows[: plan.num_real[d]] < w * r + b).all()
        assert (rows[plan.num_real[d] :] == w * r + b).all()
    ag_spec, ag = plan_exchange(plan, stats_lengths, spec, "allgather")
    assert np.array_equal(ag["rows"], plan.indices) and ag_spec.spec_out == xspec.spec_out


def test_to_device_with_places_replicated_scalars(mesh):
    host = _batches()[0]
    sharding = col.rank_sharding(mesh)
    dev, put = jb.to_device_with([host], sharding, scalars={"n": np.float32(37)})
    assert jb.to_jagged(dev)[0].diff(host) == [] and set(put) == {"n"}
    n = put["n"]
    assert n.shape == () and n.dtype == np.float32 and float(n) == 37.0
    assert n.sharding == NamedSharding(mesh, P()) and n.sharding.is_fully_replicated
    assert jb.to_device_with([host], sharding)[1] == {}  # no scalars: `to_device`'s batch
    with pytest.raises(HSTUError, match="0-d"):
        jb.to_device_with([host], sharding, scalars={"n": np.zeros(2, np.float32)})


def _cost() -> HSTUCost:
    return HSTUCost.from_model_config(load_config("configs/demo.yaml").model)


def _loss_tokens_ok(placed, stats: np.ndarray, mesh) -> None:
    """`placed` carries the stats' global loss-token count, on the devices: a float32 scalar
    replicated over the whole mesh (the sharding of the step's in_spec `P()`)."""
    count = int(stats[:, STAT_LOSS_TOKENS].sum())
    assert count > 0 and placed.loss_tokens == count
    dev = placed.loss_tokens_device
    assert isinstance(dev, jax.Array) and dev.shape == () and dev.dtype == np.float32
    assert float(dev) == float(count)
    assert dev.sharding == NamedSharding(mesh, P()) and dev.sharding.is_fully_replicated
    assert dev.sharding.device_set == set(mesh.devices.flat)


@pytest.mark.parametrize(
    "shuffler, on_host",
    [("identity", True), ("balanced", True), ("identity", False), ("balanced", False)],
)
def test_loss_tokens_ride_the_batch_copy(mesh, shuffler, on_host):
    """After the stats gather and the copy, the batch carries its loss-token count on the
    devices: identity (`ensure`), the host exchange and the device exchange alike."""
    host = _batches(num_samples=6)
    sh = JaxShuffler(mesh, "all2all", host_exchange=on_host)
    prep = sh.shuffle(host, _cost(), "ranking", shuffler=shuffler)
    _loss_tokens_ok(prep.device_batch, prep.stats, mesh)
    assert jb.to_jagged(prep.device_batch.batch)[0].diff(host[0]) == []


def test_loss_tokens_share_the_batch_device_put(mesh, monkeypatch):
    """One `jax.device_put` places the batch and its count (a second would be a transfer of
    its own); a batch that skipped the stats gather has no count."""
    host = _batches(num_samples=6)
    stats = sample_stats(host, _cost(), "ranking")
    sh = JaxShuffler(mesh)  # one process: the host exchange, the copy at `ensure`
    placed = sh.to_device(host)
    sh.allgather_stats(stats)
    assert placed.batch is None and placed.loss_tokens_device is None
    calls = []
    real_put = jax.device_put
    monkeypatch.setattr(
        jax, "device_put", lambda x, *a, **k: calls.append(x) or real_put(x, *a, **k)
    )
    sh.ensure(placed)
    monkeypatch.undo()
    assert len(calls) == 1 and set(calls[0][1]) == {"loss_tokens"}
    _loss_tokens_ok(placed, stats, mesh)
    skipped = sh.ensure(sh.to_device(host))
    assert skipped.loss_tokens is None and skipped.loss_tokens_device is None
