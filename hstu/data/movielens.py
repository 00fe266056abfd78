"""MovieLens-1M and MovieLens-20M readers, for the files exactly as GroupLens ships them.

ML-1M (`ml-1m/`): `ratings.dat` `UserID::MovieID::Rating::Timestamp` (integer stars 1..5),
`movies.dat` `MovieID::Title::Genres` and `users.dat` `UserID::Gender::Age::Occupation::Zip-code`,
latin-1, no header. ML-20M (`ml-20m/`): `ratings.csv` with header
`userId,movieId,rating,timestamp` (half stars 0.5..5.0) and `movies.csv` (`movieId,title,genres`,
titles quoted when they hold a comma).

The side files are optional; when present they are checked against: a rating whose movie (or
user) is missing from `movies.*` (`users.dat`) is an error naming the ratings line.

Actions are half-star ratings, the same vocabulary for both: `action = 2 * rating - 1`
(0 = 0.5 star ... 9 = 5 stars; ML-1M uses the odd ids only). Ranking tasks: bit 0 =
`rating >= 4` (the usual positive), bit 1 = `rating == 5`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.data.delimited import (
    Column,
    iter_lines,
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
    require_file,
)
from hstu.errors import HSTUError

HALF_STAR_ACTIONS = ActionSpec(
    num_actions=10,
    meaning="half-star rating: action = 2 * rating - 1 (0 = 0.5 star, 9 = 5 stars)",
    task_names=("rating>=4", "rating==5"),
    label_of_action=tuple(int(a >= 7) | (int(a == 9) << 1) for a in range(10)),
)
ML20M_HEADER = ("userId", "movieId", "rating", "timestamp")
USER_FEATURES = ("gender", "age", "occupation", "zip3")  # zip3: first 3 characters of the zip


def _rows_to_actions(path: Path, tenths: np.ndarray, first_line: int) -> np.ndarray:
    ok = (tenths >= 5) & (tenths <= 50) & (tenths % 5 == 0)
    bad = np.flatnonzero(~ok)
    if bad.size:
        i = int(bad[0])
        raise line_error(
            path,
            first_line + i,
            f"rating {tenths[i] / 10:g} is not a half-star value in 0.5..5.0",
        )
    return tenths // 5 - 1


def _movie_ids_dat(path: Path) -> np.ndarray:
    ids = []
    for number, text in iter_lines(path, "latin-1"):
        parts = text.split("::")
        if len(parts) != 3:
            raise line_error(
                path, number, f"expected MovieID::Title::Genres, found {len(parts)} fields"
            )
        if not parts[0].isdigit():
            raise line_error(path, number, f"MovieID must be an integer, got {parts[0]!r}")
        ids.append(int(parts[0]))
    return np.asarray(ids, dtype=np.int64)


def _users_dat(path: Path) -> ContextualTable:
    users, columns = [], [[] for _ in USER_FEATURES]
    for number, text in iter_lines(path, "latin-1"):
        parts = text.split("::")
        if len(parts) != 5:
            raise line_error(
                path,
                number,
                f"expected UserID::Gender::Age::Occupation::Zip-code, found {len(parts)} fields",
            )
        if not parts[0].isdigit():
            raise line_error(path, number, f"UserID must be an integer, got {parts[0]!r}")
        users.append(int(parts[0]))
        for col, value in zip(columns, (*parts[1:4], parts[4][:3])):
            col.append(value)
    user = np.asarray(users, dtype=np.int64)
    if len(np.unique(user)) != len(user):
        raise HSTUError(f"{path}: a UserID appears on more than one line")
    ids, num_ids = encode_categories(USER_FEATURES, columns)
    return ContextualTable(user, ids, USER_FEATURES, num_ids)


def read_ml1m(src: Path) -> RawInteractions:
    ratings = require_file(src / "ratings.dat", " (expected the ml-1m folder of GroupLens)")
    cols = read_delimited(
        ratings,
        separator="::",
        num_fields=4,
        columns=[Column("user", 0), Column("item", 1), Column("rating", 2), Column("time", 3)],
    )
    stars = cols["rating"]
    bad = np.flatnonzero((stars < 1) | (stars > 5))
    if bad.size:
        raise line_error(ratings, int(bad[0]) + 1, f"Rating {stars[bad[0]]} is not in 1..5")
    raw = RawInteractions(
        user=cols["user"],
        item=cols["item"],
        action=2 * stars - 1,
        time=cols["time"],
        sort_key=cols["time"],
        actions=HALF_STAR_ACTIONS,
        rows=[SourceRows(ratings, 0, 1)],
        source_files=[ratings],
    )
    movies, users = src / "movies.dat", src / "users.dat"
    if movies.is_file():
        check_known(raw.item, _movie_ids_dat(movies), "movie", movies, raw.where)
        raw.source_files.append(movies)
    if users.is_file():
        raw.contextual = _users_dat(users)
        check_known(raw.user, raw.contextual.user, "user", users, raw.where)
        raw.source_files.append(users)
    return raw


def read_ml20m(src: Path) -> RawInteractions:
    ratings = require_file(src / "ratings.csv", " (expected the ml-20m folder of GroupLens)")
    header = tuple(read_first_line(ratings).split(","))
    if header != ML20M_HEADER:
        missing = [c for c in ML20M_HEADER if c not in header]
        why = f"missing column(s) {missing}" if missing else "columns out of order"
        raise line_error(
            ratings, 1, f"header must be {','.join(ML20M_HEADER)!r} ({why}), got {header!r}"
        )
    cols = read_delimited(
        ratings,
        separator=",",
        num_fields=4,
        columns=[
            Column("user", 0),
            Column("item", 1),
            Column("rating", 2, kind="tenths"),
            Column("time", 3),
        ],
        skip_lines=1,
    )
    raw = RawInteractions(
        user=cols["user"],
        item=cols["item"],
        action=_rows_to_actions(ratings, cols["rating"], first_line=2),
        time=cols["time"],
        sort_key=cols["time"],
        actions=HALF_STAR_ACTIONS,
        rows=[SourceRows(ratings, 0, 2)],
        source_files=[ratings],
    )
    movies = src / "movies.csv"
    if movies.is_file():
        if not read_first_line(movies).startswith("movieId,"):
            raise line_error(movies, 1, "header must start with 'movieId,'")
        known = read_leading_ints(movies, ",", "movieId")
        check_known(raw.item, known, "movie", movies, raw.where)
        raw.source_files.append(movies)
    return raw
