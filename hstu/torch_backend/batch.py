"""Core JaggedBatch <-> TorchRec KeyedJaggedTensor (+ dense tensors), losslessly.

One KJT holds every jagged key: values are key-major (all values of key 0, then key 1, ...)
and `lengths` is `[num_keys * batch_size]`, TorchRec's layout. A KJT has a single values
tensor, so ids of every key travel as int64; the original numpy dtype of each key is kept on
the `TorchBatch` and restored by `to_jagged`, which makes the round trip byte-exact.

Host-known sizes (per-key value counts, longest sample) ride along as python ints, so device
code never needs a device->host sync to size its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.batch import JaggedBatch
from hstu.errors import HSTUError
from hstu.torch_backend.layout import TokenLayout
from hstu.torch_backend.staging import to_device_int64


@dataclass
class TorchBatch:
    kjt: KeyedJaggedTensor  # all jagged keys, key-major values (int64), lengths [K * B]
    dense: dict[str, torch.Tensor]  # dim 0 == batch_size, padding rows zero
    batch_size: int
    actual_batch_size: int
    value_dtypes: dict[str, str] = field(default_factory=dict)  # numpy dtype per jagged key
    max_seqlen: int = 0  # longest HSTU sample (C + 2L + K tokens), known on the host
    # `[num_keys, B]` lengths as the host knows them (None: read back from the device, a sync)
    host_lengths: np.ndarray | None = None
    layout: TokenLayout | None = None  # built from them when first needed (`token_layout`)

    @property
    def keys(self) -> list[str]:
        return list(self.kjt.keys())

    @property
    def device(self) -> torch.device:
        return self.kjt.values().device

    def lengths_KB(self) -> torch.Tensor:
        return self.kjt.lengths().view(len(self.keys), self.batch_size)

    def length_per_key(self) -> list[int]:
        return self.kjt.length_per_key()  # host ints, set at construction: no sync

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TorchBatch:
        device = torch.device(device)
        return replace(
            self,
            kjt=self.kjt.to(device, non_blocking=non_blocking),
            dense={k: v.to(device, non_blocking=non_blocking) for k, v in self.dense.items()},
            layout=self.layout and self.layout.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream) -> None:
        """Tell the caching allocator that `stream` uses these tensors (CUDA only)."""
        if self.device.type != "cuda":
            return
        self.kjt.record_stream(stream)
        for tensor in self.dense.values():
            tensor.record_stream(stream)
        if self.layout is not None:
            self.layout.buffer.record_stream(stream)

    def token_layout(self) -> TokenLayout | None:
        """Where every token goes (layout.py), built on the host from `host_lengths` the first
        time a step needs it and copied through the staging ring (a batch that only passes
        through, e.g. the one a balanced exchange replaces, never builds one); None when the
        batch lacks a key of the model's token table."""
        if self.layout is None:
            lengths = self.host_lengths
            if lengths is None:  # built without them (library use): read back, a sync
                lengths = self.lengths_KB().cpu().numpy()
            layout = TokenLayout.of_lengths_KB(self.keys, lengths)
            if layout is None:
                return None
            (buffer,) = to_device_int64([layout.buffer.numpy()], self.device)
            self.layout = replace(layout, buffer=buffer)
        return self.layout

    def strip_padding(self) -> TorchBatch:
        """Drop the padding rows of every field at once (jagged and dense), like the core.

        Padding rows sit at the tail with length 0, so the key-major values do not change:
        only each key's lengths and the dense rows are cut. No copy of values, no sync.
        """
        n = self.actual_batch_size
        if n == self.batch_size:
            return self
        lengths = self.lengths_KB()[:, :n].reshape(-1)
        return replace(
            self,
            kjt=make_kjt(self.keys, self.kjt.values(), lengths, n, self.length_per_key()),
            dense={k: v[:n] for k, v in self.dense.items()},
            batch_size=n,
            host_lengths=None if self.host_lengths is None else self.host_lengths[:, :n],
            layout=self.layout and self.layout.strip(n),
        )


def make_kjt(
    keys: list[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    batch_size: int,
    length_per_key: list[int],
) -> KeyedJaggedTensor:
    """A KJT with its per-key sizes filled in from the host (so it never syncs for them)."""
    offset_per_key = [0, *np.cumsum(length_per_key, dtype=np.int64).tolist()]
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=lengths,
        stride=batch_size,
        length_per_key=[int(n) for n in length_per_key],
        offset_per_key=[int(n) for n in offset_per_key],
    )


def _check_values(key: str, values: np.ndarray) -> None:
    if not np.issubdtype(values.dtype, np.integer) and values.dtype != np.bool_:
        raise HSTUError(f"jagged values['{key}'] must be integer ids, got dtype {values.dtype}")
    if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
        raise HSTUError(f"jagged values['{key}'] exceed the int64 range of a KJT")


def _flat_ids(batch: JaggedBatch) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(key-major int64 values, int64 lengths `[K * B]`, value count per key) of a batch."""
    keys = batch.keys
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    values = []
    for k in keys:
        v = np.asarray(batch.values[k])
        _check_values(k, v)
        values.append(v)
    lengths = np.concatenate([np.asarray(batch.lengths[k], np.int64) for k in keys])
    return np.concatenate(values, dtype=np.int64), lengths, [len(v) for v in values]


def _torch_batch(batch: JaggedBatch, values, lengths, host_lengths, per_key, dense) -> TorchBatch:
    keys, bs = batch.keys, int(batch.batch_size)
    seq = batch.seq_lengths()
    return TorchBatch(
        make_kjt(keys, values, lengths, bs, per_key),
        dense,
        bs,
        int(batch.actual_batch_size),
        {k: np.asarray(batch.values[k]).dtype.str for k in keys},
        int(seq.max()) if seq.size else 0,
        host_lengths.reshape(len(keys), bs),
    )


def to_torch(batch: JaggedBatch) -> TorchBatch:
    """Host JaggedBatch -> TorchBatch of CPU tensors (to a GPU: `to_device`)."""
    values, lengths, per_key = _flat_ids(batch)
    dense = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.dense.items()}
    lengths_t = torch.from_numpy(lengths)  # the host copy below stays the host's own
    return _torch_batch(batch, torch.from_numpy(values), lengths_t, lengths.copy(), per_key, dense)


def to_device(batch: JaggedBatch, device: torch.device | str) -> TorchBatch:
    """Host JaggedBatch -> TorchBatch on `device` in one transfer: ids and lengths go through
    one reused page-locked buffer (staging.py) and one `non_blocking` copy; the KJT's values
    and lengths are views of it. (Pinning each KJT field and copying it, as TorchRec's
    `pin_memory().to()` does, allocated page-locked memory every step.) Dense fields, which
    the recipes do not have, are pinned and copied one by one."""
    device = torch.device(device)
    if device.type != "cuda":
        return to_torch(batch).to(device)
    values, lengths, per_key = _flat_ids(batch)
    ids, lengths_t = to_device_int64([values, lengths], device)
    dense = {
        k: torch.from_numpy(np.ascontiguousarray(v)).pin_memory().to(device, non_blocking=True)
        for k, v in batch.dense.items()
    }
    return _torch_batch(batch, ids, lengths_t, lengths, per_key, dense)


def to_jagged(tb: TorchBatch) -> JaggedBatch:
    """TorchBatch (any device) -> host JaggedBatch with the original dtypes."""
    keys = tb.keys
    lengths_KB = tb.lengths_KB().detach().cpu().numpy().astype(np.int64)
    values = tb.kjt.values().detach().cpu().numpy()
    bounds = np.cumsum([0, *tb.length_per_key()])
    out_lengths, out_values = {}, {}
    for i, k in enumerate(keys):
        out_lengths[k] = lengths_KB[i].copy()
        dtype = np.dtype(tb.value_dtypes.get(k, "<i8"))
        out_values[k] = values[bounds[i] : bounds[i + 1]].astype(dtype)
    dense = {k: v.detach().cpu().numpy().copy() for k, v in tb.dense.items()}
    return JaggedBatch(tb.batch_size, tb.actual_batch_size, out_lengths, out_values, dense)


# ---------------------------------------------------------------------- jagged segment gather
def select_segments(
    values: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather whole segments of a flat jagged tensor: segments `indices`, in that order.

    `lengths[S]` describes `values` as S consecutive segments; the result is the chosen
    segments' values concatenated, and their lengths. `total` (host int) is the output value
    count, known from the gathered stats, so no device->host sync sizes the output.

    On CUDA this is fbgemm's `keyed_jagged_index_select_dim1` with one key whose "batch" is
    all S segments (schema in fbgemm 1.6 and 1.8: values, lengths, offsets[S+1], indices,
    batch_size, weights=None, selected_lengths_sum=None -> [values, lengths]); fbgemm-gpu-cpu
    registers no CPU kernel for it, so CPU uses the equivalent plain-torch gather below.
    """
    if indices.numel() == 0:
        return values.new_empty(0), lengths.new_empty(0)
    if values.is_cuda and lengths.numel() > 0:
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        out = torch.ops.fbgemm.keyed_jagged_index_select_dim1(
            values, lengths, offsets, indices, lengths.numel(), None, int(total)
        )
        return out[0], out[1]
    return select_segments_reference(values, lengths, indices, total)


def select_segments_reference(
    values: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `select_segments` (CPU path; the GPU test compares fbgemm against it)."""
    starts = torch.cumsum(lengths, 0) - lengths
    sel_lengths = lengths[indices]
    sel_starts = starts[indices]
    out_starts = torch.cumsum(sel_lengths, 0) - sel_lengths
    shift = torch.repeat_interleave(sel_starts - out_starts, sel_lengths, output_size=int(total))
    pos = shift + torch.arange(int(total), device=values.device, dtype=shift.dtype)
    return values[pos], sel_lengths
