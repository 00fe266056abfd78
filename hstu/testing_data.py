"""Small datasets in the publishers' exact file formats, with structure a model can learn.

Used by the data tests and by end-to-end tests that train on "real" files. The planted
structure mirrors `make_sample`'s random walk: a user drifts forward through item space (the
next item is 1-3 ids after the previous one), so the last item predicts the next far better
than popularity does; a share of events instead picks from a small Zipf-popular set, so a
popularity baseline beats random. Each item has a hidden quality (1-5 stars) that sets its
ratings / clicks up to noise, so ranking labels are learnable from the item id.

Raw ids are deliberately not dense (movie id = 3 * item + 7, user id = 10 * user + 1), rows are
shuffled the way the publishers' files are, and text fields hold non-ASCII characters and
quoted separators where the real files do.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ML1M_AGES = (1, 18, 25, 35, 45, 50, 56)
KUAIRAND_LOG_HEADER = (
    "user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,"
    "is_hate,long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,"
    "is_profile_enter,is_rand,tab"
)
KUAIRAND_USER_HEADER = (
    "user_id,user_active_degree,is_lowactive_period,is_live_streamer,is_video_author,"
    "follow_user_num,follow_user_num_range,fans_user_num,fans_user_num_range,friend_user_num,"
    "friend_user_num_range,register_days,register_days_range,onehot_feat0"
)


@dataclass(frozen=True)
class PlantedSpec:
    num_users: int = 150
    num_items: int = 500
    min_events: int = 5
    max_events: int = 40
    popular_share: float = 0.2  # events drawn from the popular set instead of the walk
    num_popular: int = 20
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_events <= self.max_events:
            raise ValueError(f"PlantedSpec: need 1 <= min_events <= max_events, got {self}")
        if 3 * self.max_events >= self.num_items:
            raise ValueError("PlantedSpec.num_items must exceed 3 * max_events (walks repeat)")


@dataclass
class PlantedEvents:
    """Events in (user, time) order; `item` dense in [0, num_items), no repeats per user."""

    user: np.ndarray
    item: np.ndarray
    stars: np.ndarray  # 1..5
    time: np.ndarray  # seconds, increasing within a user
    quality: np.ndarray  # [num_items] hidden 1..5


def planted_events(spec: PlantedSpec) -> PlantedEvents:
    rng = np.random.default_rng(spec.seed)
    lengths = rng.integers(spec.min_events, spec.max_events + 1, size=spec.num_users)
    user = np.repeat(np.arange(spec.num_users), lengths)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    steps = rng.integers(1, 4, size=len(user))
    climb = np.cumsum(steps)
    walk = rng.integers(0, spec.num_items, spec.num_users)[user] + climb - climb[first]
    item = walk % spec.num_items
    popular = rng.permutation(spec.num_items)[: spec.num_popular]
    weights = 1.0 / np.arange(1, spec.num_popular + 1)
    jump = rng.random(len(user)) < spec.popular_share
    item[jump] = rng.choice(popular, size=int(jump.sum()), p=weights / weights.sum())
    # One event per (user, item), as in MovieLens; keeps the first in time order.
    _, keep = np.unique(user * spec.num_items + item, return_index=True)
    keep.sort()
    user, item = user[keep], item[keep]
    quality = rng.integers(1, 6, size=spec.num_items)
    noise = rng.choice([-1, 0, 0, 0, 1], size=len(user))
    stars = np.clip(quality[item] + noise, 1, 5)
    gaps = rng.integers(60, 7200, size=len(user))
    start = rng.integers(978_300_000, 1_000_000_000, size=spec.num_users)
    gap_sum = np.cumsum(gaps)
    head = np.searchsorted(user, user)  # index of each user's first kept event
    time = start[user] + gap_sum - gap_sum[head]
    return PlantedEvents(user, item, stars, time, quality)


def movie_id(item):
    return 3 * np.asarray(item) + 7


def user_id(user):
    return 10 * np.asarray(user) + 1


def _write_lines(path: Path, lines, encoding="utf-8", header: str | None = None) -> Path:
    text = "".join(f"{line}\n" for line in ([header] if header else []) + list(lines))
    path.write_bytes(text.encode(encoding))
    return path


def write_ml1m(out: Path | str, spec: PlantedSpec = PlantedSpec()) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ev = planted_events(spec)
    rng = np.random.default_rng(spec.seed + 1)
    # ratings.dat is grouped by user but not time-ordered within a user.
    order = np.lexsort((rng.random(len(ev.user)), ev.user))
    cols = zip(user_id(ev.user)[order], movie_id(ev.item)[order], ev.stars[order], ev.time[order])
    _write_lines(out / "ratings.dat", (f"{u}::{m}::{r}::{t}" for u, m, r, t in cols))
    titles = (f"Café {i}: Le film, part {i % 3} (19{50 + i % 50})" for i in range(spec.num_items))
    _write_lines(
        out / "movies.dat",
        (f"{movie_id(i)}::{title}::Comedy|Drama" for i, title in enumerate(titles)),
        encoding="latin-1",
    )
    lines = (
        f"{user_id(i)}::{'MF'[i % 2]}::{ML1M_AGES[i % 7]}::{i % 21}::{55100 + 37 * i}"
        for i in range(spec.num_users)
    )
    _write_lines(out / "users.dat", lines, encoding="latin-1")
    return out


def write_ml20m(out: Path | str, spec: PlantedSpec = PlantedSpec()) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ev = planted_events(spec)
    rng = np.random.default_rng(spec.seed + 2)
    half = rng.choice([-0.5, 0.0, 0.0, 0.5], size=len(ev.user))
    rating = np.clip(ev.stars + half, 0.5, 5.0)
    order = np.lexsort((ev.item, ev.user))  # ratings.csv is sorted by userId, movieId
    cols = [user_id(ev.user), movie_id(ev.item), rating, ev.time]
    rows = zip(*(c[order].tolist() for c in cols))
    _write_lines(
        out / "ratings.csv",
        (f"{u},{m},{r:.1f},{t}" for u, m, r, t in rows),
        header="userId,movieId,rating,timestamp",
    )
    with open(out / "movies.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["movieId", "title", "genres"])
        for i in range(spec.num_items):
            w.writerow([movie_id(i), f"Amélie, part {i} ({1990 + i % 30})", "Comedy|Romance"])
    return out


def write_kuairand(
    out: Path | str, spec: PlantedSpec = PlantedSpec(), variant: str = "pure"
) -> Path:
    out = Path(out)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    ev = planted_events(spec)
    rng = np.random.default_rng(spec.seed + 3)
    time_ms = (ev.time - ev.time.min() + 1_649_376_000) * 1000 + rng.integers(0, 1000, len(ev.user))
    click = (rng.random(len(ev.user)) < ev.stars / 5.5).astype(int)
    long_view = click & (rng.random(len(ev.user)) < ev.stars / 5.0).astype(int)
    like = long_view & (ev.stars == 5) & (rng.random(len(ev.user)) < 0.5)
    flags = [click, like, like & (rng.random(len(ev.user)) < 0.3)]  # click, like, follow
    day, hour = (time_ms // 86_400_000) % 60, (time_ms // 3_600_000) % 24
    columns = (ev.user, ev.item, time_ms, *flags, long_view, ev.stars, day, hour)
    rows = [
        f"{user_id(u)},{movie_id(i)},2022{4 + d // 30:02d}{1 + d % 30:02d},{h:02d}00,{tm},"
        f"{c},{lk},{fo},0,0,0,{lv},{1000 + 500 * s},{20000 + i},0,0,{lk},0,{i % 15}"
        for u, i, tm, c, lk, fo, lv, s, d, h in zip(*columns)
    ]
    # Split by time into the two standard logs; rows inside a log are not grouped by user.
    cut = np.quantile(time_ms, 0.6)
    for name, part in (("4_08_to_4_21", time_ms <= cut), ("4_22_to_5_08", time_ms > cut)):
        idx = np.flatnonzero(part)
        idx = idx[rng.permutation(len(idx))]
        path = data / f"log_standard_{name}_{variant}.csv"
        _write_lines(path, (rows[k] for k in idx), header=KUAIRAND_LOG_HEADER)
    ranges = ["0", "(0,10]", "(10,50]", "500+"]
    with open(data / f"user_features_{variant}.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(KUAIRAND_USER_HEADER.split(","))
        for u in range(spec.num_users):
            activity = ("high_active", "full_active", "UNKNOWN")[u % 3]
            follow, fans = ranges[u % 4], ranges[(u + 1) % 4]
            w.writerow(
                [user_id(u), activity, u % 2, 0, u % 2, u, follow, 3 * u, fans, 0, "0", 400]
                + ["366-730", ""]
            )
    with open(data / f"video_features_basic_{variant}.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["video_id", "author_id", "video_type", "upload_dt", "tag"])
        for i in range(spec.num_items):
            w.writerow([movie_id(i), i // 4, "NORMAL", "2021-07-08", f"{i % 7},{i % 11}"])
    return out


def write_seq_txt(
    path: Path | str, spec: PlantedSpec = PlantedSpec(), with_time: bool = True
) -> Path:
    """Users interleaved, each user's lines in time order (the file is in global time order)."""
    ev = planted_events(spec)
    order = np.lexsort((ev.user, ev.time))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = [user_id(ev.user)[order], movie_id(ev.item)[order]]
    if with_time:
        cols.append(ev.time[order])
    return _write_lines(path, (" ".join(map(str, row)) for row in zip(*cols)))


def write_dataset(dataset: str, out: Path | str, spec: PlantedSpec = PlantedSpec()) -> Path:
    """Write `dataset`'s files under `out`; returns what `prepare` takes as `src_dir`."""
    out = Path(out)
    if dataset == "ml-1m":
        return write_ml1m(out, spec)
    if dataset == "ml-20m":
        return write_ml20m(out, spec)
    if dataset in ("kuairand-pure", "kuairand-1k"):
        return write_kuairand(out, spec, dataset.split("-")[1])
    if dataset == "seq-txt":
        return write_seq_txt(out / "events.txt", spec)
    raise ValueError(f"unknown dataset {dataset!r}")
