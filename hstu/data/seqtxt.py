"""The plain SASRec text format: `user item [timestamp]` per line, one event a line.

Fields are integers separated by one space or one tab (whichever the first line uses; the
whole file must use it), 2 or 3 fields on every line as on the first. The lines of a user are
in time order; users may interleave.

* Without a timestamp column the file order is the time order, and the stored timestamp of an
  event is its position in the user's sequence (0, 1, 2 ...), so relative-time features see
  evenly spaced events rather than nothing.
* With one, timestamps are integer seconds and must not decrease within a user in file order:
  a line whose timestamp is smaller than the same user's previous line is an error naming
  both lines ("non-monotonic"). Equal timestamps are allowed and keep file order.

There is one action (id 0) and one ranking task, "interaction", set on every event: ranking on
implicit-feedback data needs negative candidates, which this format does not carry.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.data.delimited import Column, line_error, read_delimited, read_first_line
from hstu.data.interactions import ActionSpec, RawInteractions, SourceRows
from hstu.errors import HSTUError

IMPLICIT_ACTIONS = ActionSpec(
    num_actions=1,
    meaning="implicit feedback: one action id (0)",
    task_names=("interaction",),
    label_of_action=(1,),
)


def _find_file(src: Path) -> Path:
    if src.is_file():
        return src
    files = sorted(p for p in src.glob("*.txt") if p.is_file()) if src.is_dir() else []
    if len(files) != 1:
        raise HSTUError(
            f"{src}: give the seq-txt file itself or a folder with exactly one *.txt file "
            f"(found {[p.name for p in files]})"
        )
    return files[0]


def _position_in_user(user: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows grouped by user in file order, each row's index within its user)."""
    order = np.argsort(user, kind="stable")
    grouped = user[order]
    new_user = np.ones(len(user), dtype=bool)
    new_user[1:] = grouped[1:] != grouped[:-1]
    group_start = np.maximum.accumulate(np.where(new_user, np.arange(len(user)), 0))
    position = np.empty(len(user), dtype=np.int64)
    position[order] = np.arange(len(user)) - group_start
    return order, position


def read_seq_txt(src: Path) -> RawInteractions:
    path = _find_file(src)
    first = read_first_line(path)
    separator = "\t" if "\t" in first else " "
    num_fields = len(first.split(separator))
    if num_fields not in (2, 3):
        raise line_error(
            path, 1, f"expected 'user item' or 'user item timestamp', found {num_fields} fields"
        )
    names = ("user", "item", "time")[:num_fields]
    cols = read_delimited(
        path,
        separator=separator,
        num_fields=num_fields,
        columns=[Column(name, i) for i, name in enumerate(names)],
    )
    user = cols["user"]
    order, position = _position_in_user(user)
    if num_fields == 3:
        time = cols["time"]
        t = time[order]
        same_user = user[order][1:] == user[order][:-1]
        back = np.flatnonzero(same_user & (t[1:] < t[:-1]))
        if back.size:
            rows = order[1:][back]
            k = int(np.argmin(rows))  # the violation that comes first in the file
            row, prev = int(rows[k]), int(order[back[k]])
            raise line_error(
                path,
                row + 1,
                f"timestamp {time[row]} of user {user[row]} is earlier than {time[prev]} on "
                f"line {prev + 1}: lines of a user must be in time order (non-monotonic)",
            )
        sort_key = time
    else:
        time = position
        sort_key = np.arange(len(user), dtype=np.int64)
    return RawInteractions(
        user=user,
        item=cols["item"],
        action=np.zeros(len(user), dtype=np.int64),
        time=time,
        sort_key=sort_key,
        actions=IMPLICIT_ACTIONS,
        rows=[SourceRows(path, 0, 1)],
        source_files=[path],
    )
