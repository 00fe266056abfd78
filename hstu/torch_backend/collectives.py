"""torch.distributed collectives of the balanced shuffle (NCCL on GPU, gloo on CPU).

* `allgather_stats`: the phase-1 gather of per-sample stats, `[B, S] -> [W * B, S]`.
* `allgather_exchange`: the whole batch in a fixed number of collectives whatever the number
  of keys: lengths of all keys (1), values of all keys padded to the largest rank's count (2;
  gloo has no uneven all_gather_into_tensor, and the padding size comes from the gathered stats,
  so no size collective), dense fields packed as bytes (3). Then one segment gather reorders the
  rank-major `(rank, key, sample)` segments into this rank's key-major KJT.
* `all2all_exchange`: only real samples that change rank travel (values + dense bytes: 2
  collectives, skipped when nothing moves); lengths and split sizes are known from the stats
  and padding rows are synthesised locally.

Both paths give, byte for byte, `hstu.shuffle_plan.exchange_reference`. Every size is computed
on the host from the gathered stats and the plan, identically on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hstu.errors import HSTUError
from hstu.pipeline import NUM_FIXED_STATS, STAT_TOKENS, gathered_lengths
from hstu.shuffle_plan import ShufflePlan
from hstu.torch_backend.batch import TorchBatch, make_kjt, select_segments
from hstu.torch_backend.staging import to_device_int64


def _gather_into(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    if dist.get_world_size(group) == 1:  # one rank: a copy, no NCCL launch on the host
        out.copy_(inp.view(out.shape))
        return
    # torch >= 2.13 renames all_gather_into_tensor to all_gather_single; 2.11 has only the former.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host index array on the device without blocking the host (staging.py)."""
    return to_device_int64([array], device)[0]


def allgather_stats(
    local_stats: np.ndarray, world_size: int, device: torch.device, group=None
) -> np.ndarray:
    """Collective: int64 `[B, S]` from every rank -> `[W * B, S]` (rank-major) on every rank."""
    stats = np.ascontiguousarray(local_stats, dtype=np.int64)
    if stats.ndim != 2:
        raise HSTUError(f"allgather_stats: stats must be 2-D [B, S], got {list(stats.shape)}")
    if world_size == 1:  # nothing to gather: no device round trip (and no wait for it)
        return stats.copy()
    local = torch.from_numpy(stats).to(device)
    out = torch.empty(
        (world_size * stats.shape[0], stats.shape[1]), dtype=torch.int64, device=device
    )
    _gather_into(out, local, group)
    return out.cpu().numpy()


# ------------------------------------------------------------------------------ dense bytes
@dataclass(frozen=True)
class DenseField:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # per-row shape
    num_bytes: int  # per row


def dense_layout(dense: dict[str, torch.Tensor]) -> list[DenseField]:
    return [
        DenseField(
            name,
            t.dtype,
            tuple(t.shape[1:]),
            int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size(),
        )
        for name, t in dense.items()
    ]


def pack_dense(dense: dict[str, torch.Tensor], batch_size: int) -> torch.Tensor:
    """Every dense field as raw bytes, side by side: `[B, sum(num_bytes)]` uint8 (one buffer
    whatever the number of fields and their dtypes)."""
    parts = [
        t.contiguous()
        .reshape(batch_size, int(np.prod(t.shape[1:], dtype=np.int64)))
        .view(torch.uint8)
        for t in dense.values()
    ]
    if not parts:
        return torch.zeros((batch_size, 0), dtype=torch.uint8)
    return torch.cat(parts, dim=1)


def unpack_dense(rows: torch.Tensor, layout: list[DenseField]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for f in layout:
        if rows.shape[0] == 0:  # an empty slice keeps its strides, which view() rejects
            out[f.name] = torch.empty((0, *f.shape), dtype=f.dtype, device=rows.device)
        else:
            chunk = rows[:, start : start + f.num_bytes].contiguous().view(f.dtype)
            out[f.name] = chunk.reshape(rows.shape[0], *f.shape)
        start += f.num_bytes
    return out


# ------------------------------------------------------------------------------ exchange
def _check(batch: TorchBatch, plan: ShufflePlan, stats: np.ndarray, rank: int) -> np.ndarray:
    """Host-side checks; returns the gathered lengths as `[W, B, K]`."""
    w, b, keys = plan.world_size, plan.batch_size, batch.keys
    if batch.batch_size != b:
        raise HSTUError(f"exchange: local batch_size {batch.batch_size} != plan's {b}")
    if not 0 <= rank < w:
        raise HSTUError(f"exchange: rank {rank} outside [0, {w})")
    if stats.shape != (w * b, NUM_FIXED_STATS + len(keys)):
        raise HSTUError(
            f"exchange: stats of shape {list(stats.shape)} do not match "
            f"{w} ranks x {b} samples and keys {keys}"
        )
    lengths = gathered_lengths(stats, keys)
    return (
        np.stack([lengths[k] for k in keys], axis=1).reshape(w, b, len(keys))
        if keys
        else np.zeros((w, b, 0), np.int64)
    )


def _finish(
    batch: TorchBatch,
    values,
    lengths,
    dense,
    plan,
    stats,
    rank,
    rows_global,
    lengths_BK: np.ndarray,
) -> TorchBatch:
    kjt = make_kjt(batch.keys, values, lengths, plan.batch_size, lengths_BK.sum(0).tolist())
    tokens = stats[rows_global, STAT_TOKENS]
    return TorchBatch(
        kjt,
        dense,
        plan.batch_size,
        int(plan.num_real[rank]),
        dict(batch.value_dtypes),
        int(tokens.max()) if tokens.size else 0,
        np.ascontiguousarray(lengths_BK.T),  # host-known: the token layout needs no sync
    )


def allgather_exchange(
    batch: TorchBatch, plan: ShufflePlan, stats: np.ndarray, rank: int, group=None
) -> TorchBatch:
    """Collective: gather the whole global batch (3 collectives), keep this rank's rows."""
    lengths_WBK = _check(batch, plan, stats, rank)
    w, b, k = lengths_WBK.shape
    device = batch.device
    values_per_rank = lengths_WBK.reshape(w, -1).sum(axis=1)
    max_values = int(values_per_rank.max())

    all_lengths = torch.empty(w * k * b, dtype=torch.int64, device=device)
    # Sizes are the same on every rank (shapes, gathered stats), so all ranks skip an empty
    # collective together.
    if all_lengths.numel():
        _gather_into(all_lengths, batch.kjt.lengths().to(torch.int64).contiguous(), group)
    local_values = batch.kjt.values()
    pad = max_values - local_values.numel()
    padded = torch.cat([local_values, local_values.new_zeros(pad)]) if pad else local_values
    all_values = torch.empty(w * max_values, dtype=local_values.dtype, device=device)
    if max_values:
        _gather_into(all_values, padded.contiguous(), group)
    layout = dense_layout(batch.dense)
    packed = pack_dense(batch.dense, b).to(device)
    all_dense = None
    if packed.numel():
        all_dense = torch.empty((w * b, packed.shape[1]), dtype=torch.uint8, device=device)
        _gather_into(all_dense, packed, group)

    # Segments of the gathered values, rank-major: (rank, key, sample) plus one filler
    # segment per rank covering its padding, so the plain cumsum of lengths gives the offsets.
    per_rank = all_lengths.view(w, k * b)
    filler = max_values - per_rank.sum(dim=1, keepdim=True)
    seg_lengths = torch.cat([per_rank, filler], dim=1).reshape(-1)
    rows = plan.indices[rank]
    src_rank, src_row = rows // b, rows % b
    seg_idx = src_rank[None, :] * (k * b + 1) + np.arange(k)[:, None] * b + src_row[None, :]
    lengths_BK = lengths_WBK[src_rank, src_row]
    values, lengths = select_segments(
        all_values, seg_lengths, host_to_device(seg_idx.reshape(-1), device), int(lengths_BK.sum())
    )
    if all_dense is not None:
        dense = unpack_dense(all_dense.index_select(0, host_to_device(rows, device)), layout)
    else:
        dense = unpack_dense(packed.new_zeros((b, 0)), layout)
    return _finish(batch, values, lengths, dense, plan, stats, rank, rows, lengths_BK)


def all2all_exchange(
    batch: TorchBatch, plan: ShufflePlan, stats: np.ndarray, rank: int, group=None
) -> TorchBatch:
    """Collective: send only the real samples that change rank (2 collectives, 0 if none)."""
    lengths_WBK = _check(batch, plan, stats, rank)
    w, b, k = lengths_WBK.shape
    device, me = batch.device, rank
    others = [r for r in range(w) if r != me]
    order = others + [me]  # send/receive order; what this rank keeps goes last, locally
    send_rows = {d: plan.send_local(me, d) for d in range(w)}
    recv_rows = {s: plan.send_local(s, me) for s in range(w)}  # local rows on the source
    sizes = lengths_WBK.sum(axis=2)  # [W, B] values per sample, all keys

    # Sender: one segment gather lays out (dst, key, sample) for every dst, kept rows last.
    local_seg = [(np.arange(k)[:, None] * b + send_rows[d][None, :]).reshape(-1) for d in order]
    send_counts = [int(sizes[me, send_rows[d]].sum()) if d != me else 0 for d in range(w)]
    kept_count = int(sizes[me, send_rows[me]].sum())
    picked, _ = select_segments(
        batch.kjt.values(),
        batch.kjt.lengths().to(torch.int64),
        host_to_device(np.concatenate(local_seg), device),
        sum(send_counts) + kept_count,
    )
    num_out = sum(send_counts)
    recv_counts = [int(sizes[s, recv_rows[s]].sum()) if s != me else 0 for s in range(w)]
    layout = dense_layout(batch.dense)
    packed = pack_dense(batch.dense, b).to(device)
    row_counts_out = [len(send_rows[d]) if d != me else 0 for d in range(w)]
    row_counts_in = [len(recv_rows[s]) if s != me else 0 for s in range(w)]

    # What moves, over all ranks: the same number on every rank, so an exchange with nothing
    # to move skips its collective everywhere.
    moved_rows = plan.num_moved()
    arriving = [plan.indices[d, : plan.num_real[d]] for d in range(w)]
    moved_values = sum(int(sizes.reshape(-1)[g[g // b != d]].sum()) for d, g in enumerate(arriving))
    recv_values = picked.new_empty(sum(recv_counts))
    recv_dense = packed.new_empty((sum(row_counts_in), packed.shape[1]))
    if moved_values:
        dist.all_to_all_single(
            recv_values, picked[:num_out].contiguous(), recv_counts, send_counts, group=group
        )
    if moved_rows and packed.shape[1]:
        send_dense = packed.index_select(
            0, host_to_device(np.concatenate([send_rows[d] for d in others] or [[]]), device)
        )
        dist.all_to_all_single(recv_dense, send_dense, row_counts_in, row_counts_out, group=group)

    # Receiver: runs arrived as (src, key, sample) for src in `order`; the output wants
    # (key, row) with rows in ascending source order, then zero-length padding segments.
    combined = torch.cat([recv_values, picked[num_out:]])
    seg_lengths, base, base_row, dense_rows = [], {}, {}, 0
    for s in order:
        base[s], base_row[s] = sum(len(x) for x in seg_lengths), dense_rows
        seg_lengths.append(lengths_WBK[s, recv_rows[s]].T.reshape(-1))  # (key, sample)
        dense_rows += len(recv_rows[s])
    seg_lengths.append(np.zeros(1, np.int64))  # the empty segment padding rows point at
    seg_lengths = np.concatenate(seg_lengths)
    filler = len(seg_lengths) - 1
    seg_idx = np.full((k, b), filler, dtype=np.int64)
    row_idx = np.full(b, dense_rows, dtype=np.int64)  # padding -> an appended zero row
    j = 0
    for s in range(w):  # real rows arrive in ascending source order
        n = len(recv_rows[s])
        seg_idx[:, j : j + n] = base[s] + np.arange(k)[:, None] * n + np.arange(n)[None, :]
        row_idx[j : j + n] = base_row[s] + np.arange(n)
        j += n
    rows_global = plan.indices[me]
    lengths_BK = lengths_WBK[rows_global // b, rows_global % b]
    lengths_BK[int(plan.num_real[me]) :] = 0
    values, lengths = select_segments(
        combined,
        host_to_device(seg_lengths, device),
        host_to_device(seg_idx.reshape(-1), device),
        int(lengths_BK.sum()),
    )
    all_rows = torch.cat(
        [
            recv_dense,
            packed.index_select(0, host_to_device(send_rows[me], device)),
            packed.new_zeros((1, packed.shape[1])),
        ]
    )
    dense = unpack_dense(all_rows.index_select(0, host_to_device(row_idx, device)), layout)
    return _finish(batch, values, lengths, dense, plan, stats, rank, rows_global, lengths_BK)
