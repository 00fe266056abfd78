"""The vectorised delimited-text reader: values, block boundaries, and errors with line numbers."""

import numpy as np
import pytest

from hstu.data.delimited import Column, iter_lines, read_delimited, read_leading_ints
from hstu.errors import HSTUError

COLS = [Column("user", 0), Column("item", 1), Column("rating", 2, "tenths"), Column("time", 3)]


def read(path, **kw):
    kw.setdefault("columns", COLS)
    kw.setdefault("num_fields", 4)
    kw.setdefault("separator", ",")
    return read_delimited(path, **kw)


def test_values_and_small_blocks_give_the_same_result(tmp_path):
    rng = np.random.default_rng(0)
    n = 3000
    want = {
        "user": rng.integers(0, 10**6, n),
        "item": rng.integers(0, 10**12, n),
        "rating": rng.integers(1, 11, n) * 5,
        "time": rng.integers(0, 2 * 10**9, n),
    }
    lines = [
        f"{u},{i},{r / 10:g},{t}"  # "3.5", "4", "0.5": with and without a fraction
        for u, i, r, t in zip(*(want[k].tolist() for k in ("user", "item", "rating", "time")))
    ]
    path = tmp_path / "r.csv"
    path.write_text("h,e,a,d\n" + "\n".join(lines) + "\n")
    for block_bytes in (1 << 20, 97):  # 97 bytes: lines straddle many block boundaries
        got = read(path, skip_lines=1, block_bytes=block_bytes)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_double_colon_separator_and_crlf(tmp_path):
    path = tmp_path / "ratings.dat"
    path.write_bytes(b"1::1193::5::978300760\r\n10::48::4.5::978824351\r\n")
    got = read(path, separator="::")
    np.testing.assert_array_equal(got["item"], [1193, 48])
    np.testing.assert_array_equal(got["rating"], [50, 45])
    np.testing.assert_array_equal(got["time"], [978300760, 978824351])


@pytest.mark.parametrize(
    "body, line, match",
    [
        ("1,2,3,4\n1;2;3;4\n", 2, "expected 4 fields separated by ','"),  # wrong separator
        ("1,2,3,4\n1,2,3\n", 2, "found 3"),  # missing column
        ("1,2,3,4\n1,2,3,4,5\n", 2, "found 5"),
        ("1,2,3,4\n1,x2,3,4\n", 2, "column 'item' must be a non-negative integer, got 'x2'"),
        ("1,2,3,4\n1,-2,3,4\n", 2, "got '-2'"),
        ("1,2,3,4\n1,2,3,4\n1,,3,4\n", 3, "column 'item' must be a non-negative integer"),
        ("1,2,3,4\n1,2,3.25,4\n", 2, "column 'rating' must be a number like 3 or 3.5"),
        ("1,2,.5,4\n", 1, "column 'rating'"),
        ("1,2,3.,4\n", 1, "column 'rating'"),
        ("1,2,3,4\n1,2,3,4", 2, "last line has no newline"),  # truncated download
        ("1,2,3,4\n\n1,2,3,4\n", 2, "empty line"),
        ("1,12345678901234567890,3,4\n", 1, "1..18 characters"),
    ],
)
def test_errors_name_file_and_line(tmp_path, body, line, match):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(HSTUError, match=f"bad.csv:{line}: .*{match}"):
        read(path)
    # the same line number when the error sits in a later block
    path.write_text("0,0,1,0\n" * 5000 + body)
    with pytest.raises(HSTUError, match=f"bad.csv:{line + 5000}: "):
        read(path, block_bytes=4096)


def test_leading_ints_ignore_quoted_separators(tmp_path):
    path = tmp_path / "videos.csv"
    path.write_text('video_id,tag\n7,"1,2"\n12,\n5,"x, y, z"\n')
    np.testing.assert_array_equal(read_leading_ints(path, ",", "video_id"), [7, 12, 5])


def test_iter_lines_rules(tmp_path):
    path = tmp_path / "movies.dat"
    path.write_bytes("1::Café (1995)::Drama\n".encode("latin-1"))
    assert list(iter_lines(path, "latin-1")) == [(1, "1::Café (1995)::Drama")]
    path.write_bytes(b"1::a::b\n2::c")
    with pytest.raises(HSTUError, match="movies.dat:2: last line has no newline"):
        list(iter_lines(path, "latin-1"))


@pytest.mark.parametrize("line", ["1:2:::3::4", "1::2::3:4:", "1::2::3::4:"])
def test_stray_separator_bytes(tmp_path, line):
    path = tmp_path / "ratings.dat"
    path.write_text(f"1::2::3::4\n{line}\n")
    with pytest.raises(HSTUError, match="ratings.dat:2: "):
        read(path, separator="::")
