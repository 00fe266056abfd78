"""Batch signatures: every rank's batch layout rides in the per-sample stats gather, so a rank
whose batch differs from the others' (a jagged key missing, extra or reordered, another value
dtype, a dense field of another name, dtype or shape, another batch size) is named, with the
field, on every rank right after the gather and before any exchange: no extra collective, and
no rank left waiting in a collective whose sizes disagree.

Where the signature sits in the stats (`hstu.pipeline` owns the column order):

* `NUM_SIGNATURE` columns after the fixed stats, the same value in every row of a rank: batch
  size, number of jagged keys, number of dense fields, and `DENSE_SLOTS` dense tags (field j's
  `name hash << 32 | dtype-and-shape hash`; the last slot folds every further field into one);
* per jagged key, a 31-bit tag in bits 32-62 of its length column (a 20-bit name hash and an
  11-bit dtype code); `LENGTH_MASK` recovers the length.

The gathered width must not depend on any rank's layout, or the gather itself fails: phase 1
pads the length columns to `MAX_JAGGED_KEYS` before the gather (`pad_for_gather`) and trims
them back once every rank agrees (`trim_after_check`).

Readers of the stats use `hstu.pipeline.gathered_lengths` (which masks the tags) and the
`STAT_*` columns; code that builds stats by hand must leave `NUM_SIGNATURE` columns (zeros will
do where no check runs) between the fixed stats and the lengths.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

from hstu.batch import HSTU_DENSE_KEYS, HSTU_JAGGED_KEYS, JaggedBatch
from hstu.errors import HSTUError

MAX_JAGGED_KEYS = 16  # length columns every rank sends, whatever its own key count
DENSE_SLOTS = 3
SIG_BATCH_SIZE, SIG_NUM_KEYS, SIG_NUM_DENSE, SIG_DENSE = range(4)  # offsets in the signature
NUM_SIGNATURE = SIG_DENSE + DENSE_SLOTS
LENGTH_MASK = (1 << 32) - 1
_TAG_SHIFT = 32
_NAME_BITS, _DTYPE_BITS = 20, 11
# dtype codes: an index into this table (+1), else a hash with the top bit set
_DTYPES = ("<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1", "|b1", "<f4", "<f8", "<f2")
_KNOWN_NAMES = {*HSTU_JAGGED_KEYS, *HSTU_DENSE_KEYS, "negative"}
_names: dict[tuple[int, int], str] = {}  # (bits, hash) -> name, every name this process met


@functools.cache  # every step hashes the same few names
def _hash(text: str, bits: int) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little") & ((1 << bits) - 1)
    _names.setdefault((bits, value), text)
    return value


def _name_of(value: int, bits: int) -> str | None:
    return _names.get((bits, value))


for _name in _KNOWN_NAMES:  # decodable on every rank, whatever it read itself
    _hash(_name, _NAME_BITS), _hash(_name, 31)


def _dtype_code(dtype: np.dtype) -> int:
    text = np.dtype(dtype).str
    if text in _DTYPES:
        return _DTYPES.index(text) + 1
    return (1 << (_DTYPE_BITS - 1)) | _hash(text, _DTYPE_BITS - 1)


def _dtype_name(code: int) -> str:
    if 0 < code <= len(_DTYPES):
        return np.dtype(_DTYPES[code - 1]).name
    name = _names.get((_DTYPE_BITS - 1, code & ((1 << (_DTYPE_BITS - 1)) - 1)))
    return np.dtype(name).name if name else f"dtype #{code}"


def key_tags(batch: JaggedBatch) -> np.ndarray:
    """`[num_keys]` int64: each jagged key's tag, already shifted into bits 32-62."""
    tags = []
    for key in batch.keys:
        dtype = np.asarray(batch.values[key]).dtype
        tag = (_hash(key, _NAME_BITS) << _DTYPE_BITS) | _dtype_code(dtype)
        tags.append(tag << _TAG_SHIFT)
    return np.asarray(tags, np.int64)


def _dense_layout(name: str, arr: np.ndarray) -> str:
    return f"{name}:{arr.dtype.str}:{list(arr.shape[1:])}"


def signature(batch: JaggedBatch) -> np.ndarray:
    """`[NUM_SIGNATURE]` int64 describing the batch's layout (not its contents)."""
    if len(batch.keys) > MAX_JAGGED_KEYS:
        raise HSTUError(
            f"a batch has {len(batch.keys)} jagged keys; the stats gather carries at most "
            f"{MAX_JAGGED_KEYS} (hstu.signature.MAX_JAGGED_KEYS)"
        )
    dense = [(k, np.asarray(v)) for k, v in batch.dense.items()]
    slots = [0] * DENSE_SLOTS
    for j, (name, arr) in enumerate(dense[: DENSE_SLOTS - 1]):
        slots[j] = (_hash(name, 31) << 32) | _hash(_dense_layout(name, arr), 32)
    if len(dense) >= DENSE_SLOTS:
        rest = "|".join(_dense_layout(n, a) for n, a in dense[DENSE_SLOTS - 1 :])
        slots[-1] = _hash(rest, 62)
    return np.asarray([batch.batch_size, len(batch.keys), len(dense), *slots], np.int64)


def pad_for_gather(local_stats: np.ndarray, num_fixed: int) -> np.ndarray:
    """Local stats with exactly `MAX_JAGGED_KEYS` length columns (zeros after the real ones)."""
    out = np.zeros((local_stats.shape[0], num_fixed + MAX_JAGGED_KEYS), np.int64)
    width = min(local_stats.shape[1], out.shape[1])
    out[:, :width] = local_stats[:, :width]
    return out


def local_batch_size(local_stats: np.ndarray, ranks: Sequence[int], num_fixed: int) -> int:
    """The batch size of this process's ranks, checked before the gather: a process driving
    several ranks (JAX) must not mix batch sizes, or their rows would be misattributed."""
    col = num_fixed - NUM_SIGNATURE + SIG_BATCH_SIZE
    sizes, row = {}, 0
    for r in ranks:
        sizes[r] = int(local_stats[row, col]) if row < len(local_stats) else 0
        row += sizes[r]
    first = sizes[ranks[0]] if ranks else 0
    odd = [r for r in ranks if sizes[r] != first]
    if odd or row != len(local_stats):
        r = odd[0] if odd else ranks[-1]
        raise HSTUError(
            f"batch layout differs across ranks: rank {r} has batch_size {sizes[r]} instead "
            f"of {first} (compared with rank {ranks[0]}); every rank must use data.batch_size"
        )
    return first


def _describe(
    ref: np.ndarray, odd: np.ndarray, ref_tags: np.ndarray, odd_tags: np.ndarray
) -> list[str]:
    """What differs between two ranks' signatures, field by field (names where known)."""
    out = []
    if odd[SIG_BATCH_SIZE] != ref[SIG_BATCH_SIZE]:
        out.append(f"batch_size {odd[SIG_BATCH_SIZE]} instead of {ref[SIG_BATCH_SIZE]}")

    def key_name(tag: int) -> str:
        name = _name_of(tag >> _DTYPE_BITS, _NAME_BITS)
        return (
            repr(name) if name else f"<a key this process never read, hash #{tag >> _DTYPE_BITS}>"
        )

    ref_keys = {int(t) >> _DTYPE_BITS: int(t) for t in ref_tags}
    odd_keys = {int(t) >> _DTYPE_BITS: int(t) for t in odd_tags}
    missing = [key_name(ref_keys[h]) for h in ref_keys if h not in odd_keys]
    extra = [key_name(odd_keys[h]) for h in odd_keys if h not in ref_keys]
    if missing:
        out.append(f"jagged key(s) {', '.join(missing)} missing")
    if extra:
        out.append(f"extra jagged key(s) {', '.join(extra)}")
    for h, tag in odd_keys.items():
        if h in ref_keys and ref_keys[h] != tag:
            mask = (1 << _DTYPE_BITS) - 1
            out.append(
                f"values[{key_name(tag)}] of dtype {_dtype_name(tag & mask)} instead of "
                f"{_dtype_name(ref_keys[h] & mask)}"
            )
    if not missing and not extra and list(ref_keys) != list(odd_keys):
        out.append("the jagged keys in another order")
    dense = []
    for j in range(DENSE_SLOTS):
        a, b = int(ref[SIG_DENSE + j]), int(odd[SIG_DENSE + j])
        name_a, name_b = (
            repr(_name_of(x >> 32, 31) or "<a field this process never read>") for x in (a, b)
        )
        if a == b:
            continue
        if j == DENSE_SLOTS - 1:
            dense.append(f"dense fields after the first {DENSE_SLOTS - 1} differ")
        elif not a:
            dense.append(f"an extra dense field {name_b}")
        elif not b:
            dense.append(f"dense field {name_a} missing")
        elif a >> 32 == b >> 32:
            dense.append(f"dense[{name_b}] of another dtype or shape")
        else:
            dense.append(f"dense field {name_b} where the others have {name_a}")
    if not dense and odd[SIG_NUM_DENSE] != ref[SIG_NUM_DENSE]:
        dense.append(f"{odd[SIG_NUM_DENSE]} dense fields instead of {ref[SIG_NUM_DENSE]}")
    return out + dense or ["another layout"]


def check_gathered(stats: np.ndarray, world_size: int, num_fixed: int) -> None:
    """Raise HSTUError (on every process: all hold the same gathered stats) naming the ranks
    whose batch layout differs from the majority's, and how."""
    rows = stats.shape[0] // max(world_size, 1)
    if rows == 0 or stats.shape[0] != rows * world_size:
        return  # nothing to compare (library use with empty batches)
    first = stats[::rows]  # one row per rank
    sig = first[:, num_fixed - NUM_SIGNATURE : num_fixed]
    tags = first[:, num_fixed:] >> _TAG_SHIFT
    keys = np.concatenate([sig, tags], axis=1)
    same = (keys == keys[0]).all(axis=1)
    if same.all() and (sig[:, SIG_BATCH_SIZE] == rows).all():
        return
    groups: dict[bytes, list[int]] = {}
    for r in range(world_size):
        groups.setdefault(keys[r].tobytes(), []).append(r)
    majority = max(groups.values(), key=lambda g: (len(g), -g[0]))
    ref = majority[0]
    odd = [r for r in range(world_size) if r not in majority]
    if not odd:  # every rank agrees on a batch_size the rows contradict
        raise HSTUError(
            f"batch layout: every rank reports batch_size {sig[0, SIG_BATCH_SIZE]} but sent "
            f"{rows} rows"
        )

    def tags_of(r: int) -> np.ndarray:
        return tags[r, : min(int(sig[r, SIG_NUM_KEYS]), MAX_JAGGED_KEYS)]

    lines = []
    for r in odd:
        what = _describe(sig[ref], sig[r], tags_of(ref), tags_of(r))
        lines.append(f"rank {r} has {'; '.join(what)} (compared with rank {ref})")
    raise HSTUError(
        f"batch layout differs across ranks: {lines[0]}"
        + (f"; also {'; '.join(lines[1:])}" if lines[1:] else "")
        + f"; ranks {majority} agree. Every rank must read batches of the same keys, dtypes, "
        "dense shapes and data.batch_size"
    )


def trim_after_check(stats: np.ndarray, num_fixed: int) -> np.ndarray:
    """The gathered stats with the agreed number of length columns: exactly what
    `sample_stats` of all ranks' batches gives (the tags stay; readers mask them)."""
    num_keys = int(stats[0, num_fixed - NUM_SIGNATURE + SIG_NUM_KEYS]) if len(stats) else 0
    return np.ascontiguousarray(stats[:, : num_fixed + num_keys])
