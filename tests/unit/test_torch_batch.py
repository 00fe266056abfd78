"""JaggedBatch <-> KeyedJaggedTensor: lossless both ways, TorchRec layout, padding rules."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from hstu.batch import JaggedBatch, empty_like  # noqa: E402
from hstu.config import load_config  # noqa: E402
from hstu.testing import DEMO_CONFIG, make_global_batch  # noqa: E402
from hstu.torch_backend.batch import (  # noqa: E402
    select_segments,
    select_segments_reference,
    to_device,
    to_jagged,
    to_torch,
)
from hstu.torch_backend.collectives import dense_layout, pack_dense, unpack_dense  # noqa: E402


def _batches(task: str = "retrieval") -> list[JaggedBatch]:
    cfg = load_config(DEMO_CONFIG, [f"model.task={task}", "data.max_history=16"])
    return make_global_batch(cfg, 6, (6, 4, 0, 1))


def _odd_batch() -> JaggedBatch:
    """Empty keys, an int32 key, multi-dim / bool / float dense fields, padding rows."""
    lengths = {
        "a": np.array([2, 0, 3, 0, 0], np.int64),
        "empty": np.zeros(5, np.int64),
        "small": np.array([1, 1, 0, 0, 0], np.int64),
    }
    values = {
        "a": np.array([5, -7, 2**40, 0, 9], np.int64),
        "empty": np.zeros(0, np.int64),
        "small": np.array([3, 4], np.int32),
    }
    dense = {
        "vec": np.array([[1.5, -2], [0, 3], [4, 4.25], [0, 0], [0, 0]], np.float32),
        "flag": np.array([True, False, True, False, False]),
        "sample_id": np.array([7, 8, 9, 0, 0], np.int64),
    }
    return JaggedBatch(5, 3, lengths, values, dense).validate()


@pytest.mark.parametrize(
    "make",
    [
        lambda: _batches()[0],
        lambda: _batches()[1],
        lambda: _batches("ranking")[2],
        _odd_batch,
        lambda: empty_like(_odd_batch()),
    ],
)
def test_round_trip_is_lossless(make):
    batch = make()
    tb = to_torch(batch)
    back = to_jagged(tb)
    assert not back.diff(batch), back.diff(batch)
    # the host keeps the lengths it copied, `[num_keys, B]` (the layout is built from them)
    want = np.stack([batch.lengths[k] for k in batch.keys]) if batch.keys else None
    if want is not None:
        assert np.array_equal(tb.host_lengths, want)
    assert to_jagged(to_device(batch, "cpu")).diff(batch) == []
    assert back.validate() is back
    # strip_padding agrees with the core's (jagged and dense dropped together)
    stripped = to_jagged(tb.strip_padding())
    assert not stripped.diff(batch.strip_padding()), stripped.diff(batch.strip_padding())


def test_kjt_layout_is_torchrec_key_major():
    batch = _batches()[1]
    tb = to_torch(batch)
    kjt = tb.kjt
    assert kjt.keys() == batch.keys
    assert kjt.stride() == batch.batch_size
    assert kjt.lengths().shape == (len(batch.keys) * batch.batch_size,)
    assert kjt.values().dtype == torch.int64
    expected = np.concatenate([batch.values[k] for k in batch.keys])
    np.testing.assert_array_equal(kjt.values().numpy(), expected)
    for key, jt in kjt.to_dict().items():
        np.testing.assert_array_equal(jt.lengths().numpy(), batch.lengths[key])
        np.testing.assert_array_equal(jt.values().numpy(), batch.values[key])
    assert tb.max_seqlen == int(batch.seq_lengths().max())


def test_rejects_non_integer_jagged_values():
    batch = _odd_batch()
    batch.values["a"] = batch.values["a"].astype(np.float32)
    with pytest.raises(ValueError, match="values\\['a'\\] must be integer ids"):
        to_torch(batch)


def test_select_segments_matches_numpy():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, 30)
    values = rng.integers(0, 100, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    idx = rng.permutation(30)[:17]
    want = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in idx])
    got, got_lengths = select_segments(
        torch.from_numpy(values), torch.from_numpy(lengths), torch.from_numpy(idx), len(want)
    )
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(got_lengths.numpy(), lengths[idx])
    empty, _ = select_segments(
        torch.from_numpy(values), torch.from_numpy(lengths), torch.zeros(0, dtype=torch.int64), 0
    )
    assert empty.numel() == 0


def test_dense_bytes_round_trip():
    dense = {k: torch.from_numpy(v) for k, v in _odd_batch().dense.items()}
    packed = pack_dense(dense, 5)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 8 + 1 + 8)
    back = unpack_dense(packed, dense_layout(dense))
    for k, v in dense.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    assert unpack_dense(packed[:0], dense_layout(dense))["vec"].shape == (0, 2)


@pytest.mark.gpu
def test_cuda_copy_and_fbgemm_segment_gather():
    # one pinned buffer, one copy on a side stream (to_device); ids and lengths are its views
    for batch in [*_batches(), _odd_batch(), empty_like(_odd_batch())]:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dev = to_device(batch, "cuda")
        torch.cuda.current_stream().wait_stream(stream)
        dev.record_stream(torch.cuda.current_stream())
        assert dev.device.type == "cuda"
        assert not to_jagged(dev).diff(batch)
        assert not to_jagged(dev.strip_padding()).diff(batch.strip_padding())
    batch = _batches()[0]
    rng = np.random.default_rng(1)
    lengths = torch.from_numpy(rng.integers(0, 5, 200)).cuda()
    values = torch.arange(int(lengths.sum()), device="cuda")
    idx = torch.from_numpy(rng.integers(0, 200, 300)).cuda()
    total = int(lengths[idx].sum())
    got = select_segments(values, lengths, idx, total)  # fbgemm on CUDA
    want = select_segments_reference(values, lengths, idx, total)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_staging_copies_int64_arrays_as_views_of_one_transfer():
    from hstu.torch_backend.staging import pack, to_device_int64

    arrays = [np.arange(5), np.array([7, -1], np.int32), np.zeros(0, np.int64), np.array([2**40])]
    want = [a.astype(np.int64).tolist() for a in arrays]
    got = to_device_int64(arrays, torch.device("cpu"))
    assert [t.dtype for t in got] == [torch.int64] * 4
    assert [t.tolist() for t in got] == want
    # what the ring writes into its page-locked slot (GPU test below)
    out = pack([*arrays, np.array([True, False])], np.full(10, -5, np.int64))
    assert out.tolist() == sum(want, []) + [1, 0]


@pytest.mark.gpu
def test_staging_ring_reuses_its_page_locked_buffers():
    from hstu.torch_backend.staging import SLOTS, PinnedStaging

    ring, device = PinnedStaging(), torch.device("cuda")
    rng = np.random.default_rng(0)
    outs, wants = [], []
    for _ in range(5 * SLOTS):  # every slot comes round several times, copies in flight
        arrays = [rng.integers(-(2**40), 2**40, int(n)) for n in rng.integers(0, 300, 3)]
        outs.append(ring.copy(arrays, device))
        wants.append(arrays)
    assert ring.allocations == SLOTS  # one page-locked buffer per slot, then only reuse
    big = [np.arange(50_000)]
    outs.append(ring.copy(big, device))  # a larger copy grows the slot it lands in, once
    wants.append(big)
    assert ring.allocations == SLOTS + 1
    torch.cuda.synchronize()
    for out, arrays in zip(outs, wants, strict=True):
        assert [t.cpu().numpy().tolist() for t in out] == [a.tolist() for a in arrays]
