"""What every dataset reader returns: raw interaction columns in file order, plus side tables.

Readers (`movielens.py`, `kuairand.py`, `seqtxt.py`) only parse and validate their publisher's
files; `prepare.py` turns a `RawInteractions` into the on-disk sequence format the same way for
every dataset (dense ids, per-user time order, leave-one-out splits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hstu.errors import HSTUError


@dataclass(frozen=True)
class ActionSpec:
    """How a dataset's action ids read, and which ranking label bits each action sets.

    `label_of_action[a]` is the task bitmask (bit t = task t) of an event with action `a`; the
    model's `num_tasks` keeps the low bits, so the most common tasks come first.
    """

    num_actions: int
    meaning: str
    task_names: tuple[str, ...]
    label_of_action: tuple[int, ...]

    def __post_init__(self):
        if len(self.label_of_action) != self.num_actions:
            raise ValueError(
                f"ActionSpec.label_of_action has {len(self.label_of_action)} entries, "
                f"expected num_actions={self.num_actions}"
            )
        if max(self.label_of_action) >= 2 ** len(self.task_names):
            raise ValueError("ActionSpec.label_of_action sets bits beyond task_names")


@dataclass
class ContextualTable:
    """Per-user categorical features, already encoded into one id space [0, num_ids)."""

    user: np.ndarray  # int64 [n] raw user ids, unique
    ids: np.ndarray  # int64 [n, C]: feature f of a user is in [offset_f, offset_f + vocab_f)
    names: tuple[str, ...]  # C feature names
    num_ids: int

    @classmethod
    def empty(cls) -> ContextualTable:
        return cls(np.zeros(0, np.int64), np.zeros((0, 0), np.int64), (), 0)


@dataclass
class SourceRows:
    """Where rows of the concatenated columns came from, to name a file line in errors."""

    path: Path
    first_row: int  # index of this file's first row in the concatenated columns
    first_line: int  # 1-based line number of that row in the file


@dataclass
class RawInteractions:
    user: np.ndarray  # int64 [E] raw user ids, file order
    item: np.ndarray  # int64 [E] raw item ids
    action: np.ndarray  # int64 [E] in [0, actions.num_actions)
    time: np.ndarray  # int64 [E] seconds
    sort_key: np.ndarray  # int64 [E] time order within a user (finer than `time` if known)
    actions: ActionSpec
    contextual: ContextualTable = field(default_factory=ContextualTable.empty)
    rows: list[SourceRows] = field(default_factory=list)
    source_files: list[Path] = field(default_factory=list)  # every file read, for the manifest

    def where(self, row: int) -> str:
        """`file:line` of a row (rows of several files are concatenated in `rows` order)."""
        src = max((s for s in self.rows if s.first_row <= row), key=lambda s: s.first_row)
        return f"{src.path}:{src.first_line + row - src.first_row}"


def encode_categories(
    names: Sequence[str], columns: Sequence[Sequence[str]]
) -> tuple[np.ndarray, int]:
    """[n, C] ids of string categories: feature f's sorted distinct values take the ids
    `[offset_f, offset_f + vocab_f)`, offsets stacked in feature order, so one embedding table
    of `num_ids` rows holds every feature and ids never depend on row order."""
    n = len(columns[0]) if columns else 0
    ids = np.zeros((n, len(names)), dtype=np.int64)
    offset = 0
    for f, values in enumerate(columns):
        vocab, inverse = np.unique(np.asarray(values, dtype=str), return_inverse=True)
        ids[:, f] = offset + inverse
        offset += len(vocab)
    return ids, offset


def check_known(raw_ids: np.ndarray, known: np.ndarray, what: str, side_file: Path, where) -> None:
    """Raise naming the first row whose id is absent from a side file (movies.dat, ...)."""
    known = np.unique(known)
    pos = np.clip(np.searchsorted(known, raw_ids), 0, max(len(known) - 1, 0))
    missing = np.flatnonzero(known[pos] != raw_ids) if known.size else np.arange(len(raw_ids))
    if missing.size:
        row = int(missing[0])
        raise HSTUError(
            f"{where(row)}: {what} {int(raw_ids[row])} is not in {side_file.name} "
            f"({missing.size} rows have unknown {what}s)"
        )


def require_file(path: Path, hint: str = "") -> Path:
    if not path.is_file():
        raise HSTUError(f"{path}: no such file{hint}")
    return path
