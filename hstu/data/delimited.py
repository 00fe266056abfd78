"""Vectorised reading of large delimited text files (ratings, interaction logs), numpy only.

Per-line Python costs about 1 us a field, so a 20M-row file would take a minute; here a file is
read in blocks of whole lines and every step (line and field boundaries, digit decoding,
validation) is a numpy operation over the block. Errors name the file and the 1-based line.

Rules shared by every format read here:

* Lines end with `\\n` (a `\\r` before it is dropped). The last line must end with one too:
  publishers' files do, and a download cut mid-number still parses as a valid id, so a missing
  final newline is the one reliable sign of a truncated file and is rejected.
* Every line has exactly `num_fields` fields; an empty line is an error.
* `int` fields are non-negative decimal integers of at most 18 digits (no sign, no spaces).
  `tenths` fields are decimals with at most one fractional digit, returned times ten
  ("3.5" -> 35, "4" -> 40), which is exact for half-star ratings.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hstu.errors import HSTUError

NEWLINE, CR, DOT, ZERO = ord("\n"), ord("\r"), ord("."), ord("0")
MAX_DIGITS = 18  # 10**18 < 2**63: every accepted integer fits int64
BLOCK_BYTES = 2 << 20  # small enough for the temporaries of a block to stay in cache


@dataclass(frozen=True)
class Column:
    name: str
    index: int  # 0-based field position in the line
    kind: str = "int"  # int | tenths

    def __post_init__(self):
        if self.kind not in ("int", "tenths"):
            raise ValueError(f"Column.kind={self.kind!r} must be 'int' or 'tenths'")
        if self.index < 0:
            raise ValueError(f"Column.index={self.index} must be >= 0")


def line_error(path: Path | str, line: int, message: str) -> HSTUError:
    return HSTUError(f"{path}:{line}: {message}")


@dataclass
class _Block:
    """Whole lines of a file: bytes, per-line [start, end) without the newline, line numbers."""

    data: np.ndarray  # uint8
    starts: np.ndarray  # int64 [n]
    ends: np.ndarray  # int64 [n]
    first_line: int  # 1-based number of line 0

    def text(self, i: int, lo: int | None = None, hi: int | None = None) -> str:
        lo = self.starts[i] if lo is None else lo
        hi = self.ends[i] if hi is None else hi
        return bytes(self.data[lo:hi]).decode("utf-8", "replace")


def _blocks(path: Path, skip_lines: int, block_bytes: int) -> Iterator[_Block]:
    """Blocks of whole lines after the first `skip_lines`; rejects a missing final newline."""
    line_no = 1
    carry = b""
    with open(path, "rb") as f:
        for _ in range(skip_lines):
            if not f.readline().endswith(b"\n"):
                raise line_error(path, line_no, "file ends inside the header (truncated file?)")
            line_no += 1
        while True:
            chunk = f.read(block_bytes)
            data = carry + chunk
            if not chunk:
                if data:
                    raise line_error(
                        path,
                        line_no + data.count(b"\n"),
                        "last line has no newline: the file looks truncated (if it is intact, "
                        "append a newline)",
                    )
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a block: read on
                carry = data
                continue
            carry = data[cut:]
            arr = np.frombuffer(data, dtype=np.uint8, count=cut)
            ends = np.flatnonzero(arr == NEWLINE)
            starts = np.empty_like(ends)
            starts[0] = 0
            starts[1:] = ends[:-1] + 1
            if ends.size:  # drop the \r of CRLF line ends
                has_cr = (ends > starts) & (arr[np.maximum(ends - 1, 0)] == CR)
                ends = ends - has_cr
            yield _Block(arr, starts, ends, line_no)
            line_no += len(ends)


def _field_bounds(
    block: _Block, path: Path, separator: bytes, num_fields: int
) -> tuple[np.ndarray, np.ndarray]:
    """[n, num_fields] start and end offsets of every field; errors name the first bad line."""
    if len(set(separator)) != 1:
        raise ValueError(f"separator {separator!r} must repeat one byte (',', '::', ' ')")
    width, sep_byte = len(separator), separator[0]
    arr, starts, ends = block.data, block.starts, block.ends
    n = len(starts)
    empty = np.flatnonzero(ends == starts)
    if empty.size:
        raise line_error(path, block.first_line + int(empty[0]), "empty line")
    pos = np.flatnonzero(arr == sep_byte)
    per_line = width * (num_fields - 1)
    ok = pos.size == n * per_line
    if ok and per_line:
        grid = pos.reshape(n, per_line)
        # All separators of row i must lie inside line i, and multi-byte ones be adjacent.
        ok = bool(np.all(grid[:, 0] >= starts) and np.all(grid[:, -1] < ends))
        if ok and width > 1:
            ok = bool(np.all(np.diff(grid.reshape(n, num_fields - 1, width), axis=2) == 1))
    if not ok:
        _raise_first_bad_line(block, path, separator, num_fields)
    bounds_lo = np.empty((n, num_fields), dtype=np.int64)
    bounds_hi = np.empty((n, num_fields), dtype=np.int64)
    bounds_lo[:, 0], bounds_hi[:, -1] = starts, ends
    if per_line:
        groups = pos.reshape(n, num_fields - 1, width)
        bounds_hi[:, :-1] = groups[:, :, 0]
        bounds_lo[:, 1:] = groups[:, :, -1] + 1
    return bounds_lo, bounds_hi


def _raise_first_bad_line(block: _Block, path: Path, separator: bytes, num_fields: int) -> None:
    """The error path: a Python pass over the block's lines finds the first bad one."""
    sep = separator.decode()
    for i in range(len(block.starts)):
        text = block.text(i)
        fields = text.split(sep)
        if len(fields) != num_fields:
            raise line_error(
                path,
                block.first_line + i,
                f"expected {num_fields} fields separated by {sep!r}, found {len(fields)}: "
                f"{text[:120]!r} (wrong separator or a missing column?)",
            )
        if text.count(sep[0]) != len(sep) * (num_fields - 1):
            raise line_error(path, block.first_line + i, f"stray {sep[0]!r} in {text[:120]!r}")
    raise AssertionError("the vectorised field check failed but no line is bad")


def _parse_fields(
    block: _Block, path: Path, lo: np.ndarray, hi: np.ndarray, column: Column
) -> np.ndarray:
    """Decode one column of a block (int64); errors name the first bad line."""
    tenths = column.kind == "tenths"
    what = "a number like 3 or 3.5" if tenths else "a non-negative integer"
    max_chars = MAX_DIGITS - 1 if tenths else MAX_DIGITS  # x10 must still fit int64
    lengths = hi - lo
    bad_len = np.flatnonzero((lengths == 0) | (lengths > max_chars))
    if bad_len.size:
        i = int(bad_len[0])
        raise line_error(
            path,
            block.first_line + i,
            f"column '{column.name}' must be {what} of 1..{max_chars} characters, "
            f"got {block.text(i, lo[i], hi[i])!r}",
        )
    width = int(lengths.max()) if lengths.size else 0
    shortest = int(lengths.min()) if lengths.size else 0
    value = np.zeros(len(lo), dtype=np.int64)
    valid = np.ones(len(lo), dtype=bool)
    dots = np.zeros(len(lo), dtype=np.int64)
    frac_digits = np.zeros(len(lo), dtype=np.int64)
    # Horner's rule over the fields right-aligned to a common width, one byte column at a time:
    # a handful of in-place vector passes instead of one Python call per field.
    for k in range(width):
        pos = hi - (width - k)
        if k >= width - shortest:  # every field has a byte here
            present = None
            digit = block.data[pos] - np.uint8(ZERO)  # non-digits wrap above 9
            is_digit = digit <= 9
        else:
            present = pos >= lo
            digit = block.data[np.maximum(pos, 0)] - np.uint8(ZERO)
            digit *= present
            is_digit = present & (digit <= 9)
        if tenths:
            present = np.ones(len(lo), dtype=bool) if present is None else present
            is_dot = present & (digit == np.uint8((DOT - ZERO) % 256))
            valid &= is_digit | is_dot | ~present
            valid &= ~(is_dot & (pos == lo))  # ".5": no integer part
            frac_digits += is_digit & (dots > 0)
            dots += is_dot
            value = np.where(is_dot, value, value * 10 + np.where(is_digit, digit, 0))
        else:
            valid &= is_digit if present is None else is_digit | ~present
            value *= 10
            value += digit
    scale = 1
    if tenths:
        # One dot at most, followed by exactly one digit ("3." and "3.25" are rejected).
        valid &= (dots == 0) | ((dots == 1) & (frac_digits == 1))
        scale = np.where(dots == 0, 10, 1)
    bad = np.flatnonzero(~valid)
    if bad.size:
        i = int(bad[0])
        raise line_error(
            path,
            block.first_line + i,
            f"column '{column.name}' must be {what}, got {block.text(i, lo[i], hi[i])!r}",
        )
    return value * scale


def read_delimited(
    path: Path | str,
    *,
    separator: str,
    num_fields: int,
    columns: Sequence[Column],
    skip_lines: int = 0,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, np.ndarray]:
    """The named columns of every line after `skip_lines`, as int64 arrays in file order.

    Rows map to lines one to one: row `r` is line `skip_lines + r + 1`, which is how callers
    name the line of a row that fails a later check (an unknown id, a time going backwards).
    """
    path = Path(path)
    if not path.is_file():
        raise HSTUError(f"{path}: no such file")
    for c in columns:
        if c.index >= num_fields:
            raise ValueError(f"column {c.name!r} index {c.index} >= num_fields {num_fields}")
    parts: dict[str, list[np.ndarray]] = {c.name: [] for c in columns}
    for block in _blocks(path, skip_lines, block_bytes):
        lo, hi = _field_bounds(block, path, separator.encode(), num_fields)
        for c in columns:
            parts[c.name].append(_parse_fields(block, path, lo[:, c.index], hi[:, c.index], c))
    out = {
        name: np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for name, p in parts.items()
    }
    return out


def read_first_line(path: Path | str) -> str:
    """The first line without its line end (a header), decoded as UTF-8."""
    with open(path, "rb") as f:
        line = f.readline()
    if not line.endswith(b"\n"):
        raise line_error(path, 1, "file ends inside the first line (empty or truncated file?)")
    return line.rstrip(b"\r\n").decode("utf-8", "replace")


def read_leading_ints(
    path: Path | str, separator: str, name: str, skip_lines: int = 1
) -> np.ndarray:
    """The first field of every line as int64: ids of files whose other fields may be quoted
    CSV with separators inside (KuaiRand video features), where a full split would be wrong."""
    path = Path(path)
    sep = ord(separator)
    parts = []
    for block in _blocks(path, skip_lines, BLOCK_BYTES):
        empty = np.flatnonzero(block.ends == block.starts)
        if empty.size:
            raise line_error(path, block.first_line + int(empty[0]), "empty line")
        pos = np.append(np.flatnonzero(block.data == sep), len(block.data))
        first_sep = pos[np.searchsorted(pos, block.starts)]
        hi = np.minimum(first_sep, block.ends)
        parts.append(_parse_fields(block, path, block.starts, hi, Column(name, 0)))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def iter_lines(path: Path | str, encoding: str = "utf-8", skip_lines: int = 0):
    """(1-based line number, text) of each line of a small side file, for per-line parsing
    where vectorising does not pay (a few thousand lines); same newline rules as above."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        raise line_error(
            path,
            data.count(b"\n") + 1,
            "last line has no newline: the file looks truncated (if it is intact, append one)",
        )
    for number, raw in enumerate(data.split(b"\n")[:-1], start=1):
        if number <= skip_lines:
            continue
        try:
            text = raw.rstrip(b"\r").decode(encoding)
        except UnicodeDecodeError as e:
            raise line_error(path, number, f"not {encoding} text: {e}") from None
        if not text:
            raise line_error(path, number, "empty line")
        yield number, text
