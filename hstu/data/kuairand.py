"""KuaiRand-Pure and KuaiRand-1K readers, for the files as the KuaiRand authors ship them.

`--src` is the release folder or its `data/` folder. Read:

* `log_standard_*_{pure,1k}*.csv`: every standard-feed log, in name order (4_08_to_4_21 before
  4_22_to_5_08; `_partN` files of the big release in order). `log_random_*` (randomly exposed
  videos, an off-policy evaluation set) is not part of the sequences. Columns are found by
  header name; the published header is `user_id,video_id,date,hourmin,time_ms,is_click,
  is_like,is_follow,is_comment,is_forward,is_hate,long_view,play_time_ms,duration_ms,
  profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab` (kuairand.com). Only
  `user_id`, `video_id`, `time_ms` and the flags below are required.
* `user_features_*.csv` (optional): categorical user features -> contextual ids.
* `video_features_basic_*.csv` (optional): only its `video_id` column, to reject unknown videos.

Actions are the bitmask of the interaction flags in `FLAGS` order (256 action ids), and the
ranking label of an event is the same bitmask: with `model.num_tasks = 2` the tasks are
click and long view, the two most used KuaiRand targets. Events are ordered by `time_ms`;
timestamps are stored in seconds.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from hstu.data.delimited import (
    Column,
    line_error,
    read_delimited,
    read_first_line,
    read_leading_ints,
)
from hstu.data.interactions import (
    ActionSpec,
    ContextualTable,
    RawInteractions,
    SourceRows,
    check_known,
    encode_categories,
)
from hstu.errors import HSTUError

FLAGS = (
    "is_click",
    "long_view",
    "is_like",
    "is_follow",
    "is_comment",
    "is_forward",
    "is_hate",
    "is_profile_enter",
)
FLAG_ACTIONS = ActionSpec(
    num_actions=2 ** len(FLAGS),
    meaning="bitmask of the interaction flags, bit i = " + ", ".join(FLAGS),
    task_names=FLAGS,
    label_of_action=tuple(range(2 ** len(FLAGS))),
)
USER_FEATURES = (
    "user_active_degree",
    "is_lowactive_period",
    "is_live_streamer",
    "is_video_author",
    "follow_user_num_range",
    "fans_user_num_range",
    "friend_user_num_range",
    "register_days_range",
)
VARIANTS = {"kuairand-pure": "pure", "kuairand-1k": "1k"}


def _data_dir(src: Path, suffix: str) -> Path:
    for folder in (src, src / "data"):
        if any(folder.glob(f"log_standard_*_{suffix}*.csv")):
            return folder
    raise HSTUError(
        f"{src}: no log_standard_*_{suffix}*.csv here or in {src / 'data'} "
        f"(expected the KuaiRand-{suffix.capitalize()} release folder)"
    )


def _read_log(path: Path) -> dict[str, np.ndarray]:
    header = read_first_line(path).split(",")
    wanted = ("user_id", "video_id", "time_ms", *FLAGS)
    missing = [c for c in wanted if c not in header]
    if missing:
        raise line_error(path, 1, f"header lacks column(s) {missing}; it has {header}")
    cols = read_delimited(
        path,
        separator=",",
        num_fields=len(header),
        columns=[Column(c, header.index(c)) for c in wanted],
        skip_lines=1,
    )
    action = np.zeros(len(cols["user_id"]), dtype=np.int64)
    for bit, flag in enumerate(FLAGS):
        bad = np.flatnonzero(cols[flag] > 1)
        if bad.size:
            i = int(bad[0])
            raise line_error(path, i + 2, f"column '{flag}' must be 0 or 1, got {cols[flag][i]}")
        action |= cols[flag] << bit
    cols["action"] = action
    return cols


def _user_features(path: Path) -> ContextualTable:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None) or []
        missing = [c for c in ("user_id", *USER_FEATURES) if c not in header]
        if missing:
            raise line_error(path, 1, f"header lacks column(s) {missing}")
        where = [header.index(c) for c in USER_FEATURES]
        users, columns = [], [[] for _ in USER_FEATURES]
        for row in reader:
            if len(row) != len(header):
                raise line_error(
                    path, reader.line_num, f"expected {len(header)} fields, found {len(row)}"
                )
            uid = row[header.index("user_id")]
            if not uid.isdigit():
                raise line_error(path, reader.line_num, f"user_id must be an integer: {uid!r}")
            users.append(int(uid))
            for col, i in zip(columns, where):
                col.append(row[i])
    ids, num_ids = encode_categories(USER_FEATURES, columns)
    return ContextualTable(np.asarray(users, dtype=np.int64), ids, USER_FEATURES, num_ids)


def read_kuairand(src: Path, dataset: str) -> RawInteractions:
    suffix = VARIANTS[dataset]
    folder = _data_dir(src, suffix)
    logs = sorted(folder.glob(f"log_standard_*_{suffix}*.csv"))
    parts, rows, first_row = [], [], 0
    for log in logs:
        cols = _read_log(log)
        parts.append(cols)
        rows.append(SourceRows(log, first_row, 2))
        first_row += len(cols["user_id"])
    time_ms = np.concatenate([p["time_ms"] for p in parts])
    raw = RawInteractions(
        user=np.concatenate([p["user_id"] for p in parts]),
        item=np.concatenate([p["video_id"] for p in parts]),
        action=np.concatenate([p["action"] for p in parts]),
        time=time_ms // 1000,
        sort_key=time_ms,
        actions=FLAG_ACTIONS,
        rows=rows,
        source_files=list(logs),
    )
    users = folder / f"user_features_{suffix}.csv"
    if users.is_file():
        raw.contextual = _user_features(users)
        if len(np.unique(raw.contextual.user)) != len(raw.contextual.user):
            raise HSTUError(f"{users}: a user_id appears on more than one line")
        check_known(raw.user, raw.contextual.user, "user_id", users, raw.where)
        raw.source_files.append(users)
    videos = folder / f"video_features_basic_{suffix}.csv"
    if videos.is_file():
        if not read_first_line(videos).startswith("video_id,"):
            raise line_error(videos, 1, "header must start with 'video_id,'")
        known = read_leading_ints(videos, ",", "video_id")
        check_known(raw.item, known, "video_id", videos, raw.where)
        raw.source_files.append(videos)
    return raw
