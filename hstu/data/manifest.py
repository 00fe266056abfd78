"""The prepared-dataset directory: numpy arrays opened memory-mapped, and `manifest.json`.

Layout (U users, E events, I items, C contextual features per user):

| file              | dtype | shape   | content                                             |
|-------------------|-------|---------|-----------------------------------------------------|
| `offsets.npy`     | int64 | [U + 1] | user u's events are rows `offsets[u]:offsets[u+1]`  |
| `num_train.npy`   | int64 | [U]     | u's first `num_train[u]` events: its train split    |
| `item.npy`        | int32 | [E]     | dense item ids in [0, I), time order within a user  |
| `action.npy`      | int32 | [E]     | action ids in [0, num_actions) (`action_meaning`)   |
| `time.npy`        | int64 | [E]     | timestamps, seconds                                 |
| `contextual.npy`  | int32 | [U, C]  | contextual feature ids in [0, num_contextual_ids)   |
| `item_raw_id.npy` | int64 | [I]     | dense item id -> the publisher's id (ascending)     |
| `user_raw_id.npy` | int64 | [U]     | dense user id -> the publisher's id (ascending)     |

Values + offsets is TorchRec's jagged convention (offsets with a leading 0). Loading is
`np.load(..., mmap_mode="r")` of each file plus this small JSON: no per-row work, so a 20M-event
dataset opens in milliseconds. The manifest is written last: a directory without one is an
interrupted `prepare` and is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hstu.errors import HSTUError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = {  # name -> dtype; the order is the checksum order
    "offsets": np.int64,
    "num_train": np.int64,
    "item": np.int32,
    "action": np.int32,
    "time": np.int64,
    "contextual": np.int32,
    "item_raw_id": np.int64,
    "user_raw_id": np.int64,
}


@dataclass
class Manifest:
    dataset: str
    num_users: int
    num_items: int
    num_events: int
    num_events_per_split: dict[str, int]  # train / valid / test
    num_eval_users: int  # users with a valid and a test event
    max_sequence_length: int  # longest user sequence (all splits)
    max_train_length: int
    num_actions: int
    action_meaning: str
    task_names: list[str]
    label_of_action: list[int]  # task bitmask of each action id
    num_contextual: int  # C: contextual ids per user
    contextual_names: list[str]
    num_contextual_ids: int
    min_user_events: int
    num_dropped_users: int  # users below min_user_events, left out entirely
    split_rule: str
    seed: int  # default seed of samplers opened on this directory
    sources: list[dict] = field(default_factory=list)  # {"name", "bytes"} of every file read
    arrays: dict[str, dict] = field(default_factory=dict)  # name -> dtype, shape, sha256
    checksum: str = ""  # sha256 over the arrays' sha256 in ARRAYS order
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def load(cls, directory: Path | str) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise HSTUError(
                f"{directory}: no {MANIFEST}: not a prepared dataset, or `hstu data prepare` "
                "was interrupted (run it again)"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise HSTUError(f"{path}: not valid JSON ({e})") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise HSTUError(
                f"{path}: format_version {data.get('format_version')} is not "
                f"{FORMAT_VERSION}: prepare the dataset again with this version"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - names), sorted(names - set(data))
        if unknown or missing:
            raise HSTUError(f"{path}: unknown key(s) {unknown}, missing key(s) {missing}")
        return cls(**data)


def _sha256(array: np.ndarray) -> str:
    # Hash in slices so that a memory-mapped array is never copied whole.
    h = hashlib.sha256()
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    for lo in range(0, len(flat), 64 << 20):
        h.update(flat[lo : lo + (64 << 20)])
    return h.hexdigest()


def combined_checksum(arrays: dict[str, dict]) -> str:
    h = hashlib.sha256()
    for name in ARRAYS:
        h.update(f"{name}:{arrays[name]['sha256']};".encode())
    return h.hexdigest()


def write_arrays(directory: Path, arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    """Save every array of the layout with its dtype; return its manifest entries."""
    if set(arrays) != set(ARRAYS):
        raise AssertionError(f"arrays {sorted(arrays)} != layout {sorted(ARRAYS)}")
    entries = {}
    for name, dtype in ARRAYS.items():
        array = np.ascontiguousarray(arrays[name], dtype=dtype)
        np.save(directory / f"{name}.npy", array, allow_pickle=False)
        entries[name] = {
            "dtype": np.dtype(dtype).name,
            "shape": list(array.shape),
            "sha256": _sha256(array),
        }
    return entries


def open_arrays(directory: Path | str, manifest: Manifest) -> dict[str, np.ndarray]:
    """Memory-map every array and check dtype and shape against the manifest (cheap)."""
    out = {}
    for name in ARRAYS:
        path = Path(directory) / f"{name}.npy"
        if not path.is_file():
            raise HSTUError(f"{path}: missing (the prepared dataset is incomplete)")
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        want = manifest.arrays[name]
        if array.dtype.name != want["dtype"] or list(array.shape) != want["shape"]:
            raise HSTUError(
                f"{path}: {array.dtype.name}{list(array.shape)} does not match the manifest's "
                f"{want['dtype']}{want['shape']} (files from another preparation?)"
            )
        out[name] = array
    return out


def verify_checksums(directory: Path | str, manifest: Manifest | None = None) -> None:
    """Re-hash every array (reads all the data: seconds per GB) and compare with the manifest."""
    manifest = manifest or Manifest.load(directory)
    arrays = open_arrays(directory, manifest)
    for name, array in arrays.items():
        if _sha256(array) != manifest.arrays[name]["sha256"]:
            raise HSTUError(f"{Path(directory) / name}.npy: checksum mismatch (file changed)")
    if combined_checksum(manifest.arrays) != manifest.checksum:
        raise HSTUError(f"{Path(directory) / MANIFEST}: checksum field does not match arrays")
