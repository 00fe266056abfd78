"""Equal-cardinality multiway number partitioning.

Split `n = W * c` sample workloads into `W` parts of exactly `c` samples each, minimising the
largest part sum (the step time of the slowest data-parallel rank).

Methods
-------
``"kk"``
    Balanced largest differencing (the equal-cardinality Karmarkar-Karp variant): the sorted
    workloads are cut into `c` consecutive groups of `W`; every group is a `W`-tuple state that
    holds one sample per part. The two states of largest spread (max - min slot sum) are merged
    repeatedly, pairing the heaviest slot of one with the lightest slot of the other, until one
    state is left. Each merge keeps one sample per group in every slot, so every part ends with
    exactly `c` samples. Pure Python, heap ordered by spread. Strong on light tails, weak when a
    few samples dominate (a heavy sample's part collects one sample of every group).
``"greedy"``
    LPT with cardinality: samples in descending order, each to the lightest part with room.
``"auto"`` (default)
    1. Giants: when the subset bound (see `lower_bound`) shows that the `g` largest samples
       need the `g (c - 1)` smallest ones as companions, those go together (LPT among them),
       and the rest is examined the same way with `W - g` parts.
    2. LPT with cardinality on what is left (the ``"greedy"`` result when there are no giants).
    3. Local search on the heaviest part, vectorised with numpy: the best exchange of one of
       its samples with one sample of any other part (a single `searchsorted` over all
       candidates, minimising the larger of the two new sums); when none helps and `c <= 32`,
       the best two-for-two exchange. It stops as soon as the largest sum reaches the exact
       lower bound (for `n > 512`: comes within a relative `1e-5` of it), when no exchange
       helps, or when its budget of candidate evaluations (64 per sample) is spent.
    4. Unless the bound was reached: for `n <= 512` always, for larger inputs when the result
       is still more than `1e-3` above the bound, the ``"kk"`` start (and the ``"greedy"`` one
       when there were giants) is refined the same way and the best result is kept.

    So ``"auto"`` is never worse than ``"kk"`` or ``"greedy"`` for `n <= 512`, never worse
    than ``"greedy"`` without giants, and otherwise within `1e-3` of the bound or no worse
    than both. 2048 samples over 16 parts take about half a millisecond on two (busy) cores;
    `python -m hstu.bench.balance` measures quality and time on a grid.

Determinism
-----------
All decisions are taken in exact integer arithmetic. Integral workloads (int or float dtype)
with `n * max < 2**53` are used as they are, so int and float inputs holding the same values
give the same partition; other workloads are scaled by a power of two (exact) and floored to
integers with `n * max < 2**52`. Every tie goes to the lower index (sample or part) and no sort
depends on the algorithm the platform's numpy uses for equal keys, so the same input yields the
same output on every machine.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from hstu.errors import HSTUError

__all__ = ["METHODS", "imbalance", "lower_bound", "part_sums", "partition"]

METHODS = ("auto", "kk", "greedy")

_EXACT_LIMIT = 2**53  # integral data with n * max below this is exact in int64 and float64
_SMALL_N = 512  # auto also refines kk and greedy starts up to this many samples
_REL_TOL = 1e-5  # beyond _SMALL_N, auto stops once max part sum <= LB * (1 + _REL_TOL)
_RETRY_EXCESS = 1e-3  # beyond _SMALL_N, kk and greedy starts are tried above LB * (1 + this)
_MAX_C_PAIRS = 32  # two-for-two exchanges are searched up to this many samples per part
_SEARCH_BUDGET = 64  # local search evaluates at most this many candidate exchanges per sample
_SUBSET_T_MAX = 64  # subset bound: largest number of top samples considered
_GIANT_LEVELS = 4  # giants are looked for this many times (each time among what is left)
_INT64_MAX = np.iinfo(np.int64).max


# ----------------------------------------------------------------------------- validation


def _check_num_parts(num_parts) -> int:
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)):
        raise HSTUError(f"num_parts must be an integer >= 1, got {num_parts!r}")
    if num_parts < 1:
        raise HSTUError(f"num_parts must be >= 1, got {num_parts}")
    return int(num_parts)


def _as_workloads(workloads) -> np.ndarray:
    """Validated 1-D int64 or float64 array of the workloads."""
    w = np.asarray(workloads)
    if w.ndim != 1:
        raise HSTUError(f"workloads must be 1-D, got shape {list(w.shape)}")
    if w.dtype.kind == "b":
        w = w.astype(np.int64)
    elif w.dtype.kind in "iu":
        if w.dtype.kind == "u" and w.size and int(w.max()) >= 2**63:
            raise HSTUError(f"workloads: value {int(w.max())} does not fit in int64")
        w = w.astype(np.int64, copy=False)
    elif w.dtype.kind == "f":
        w = w.astype(np.float64, copy=False)
        if w.size and not np.all(np.isfinite(w)):
            bad = np.flatnonzero(~np.isfinite(w))[:5]
            raise HSTUError(
                f"workloads must be finite, got {w[bad].tolist()} at indices {bad.tolist()}"
            )
    else:
        raise HSTUError(f"workloads must be integer or float, got dtype {w.dtype}")
    if w.size and w.min() < 0:
        bad = np.flatnonzero(w < 0)[:5]
        raise HSTUError(f"workloads must be >= 0, got {w[bad].tolist()} at indices {bad.tolist()}")
    return w


def _check_divisible(n: int, num_parts: int) -> int:
    if n % num_parts:
        raise HSTUError(
            f"len(workloads)={n} is not divisible by num_parts={num_parts}: equal-size parts "
            f"need a multiple of num_parts samples"
        )
    return n // num_parts


def _to_exact_int(w: np.ndarray) -> np.ndarray:
    """Integer workloads (int64, `n * max < 2**53`) on which every decision is taken exactly.

    Integral inputs small enough are kept as they are (same result for int and float dtypes);
    anything else is scaled by a power of two and floored.
    """
    n = w.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    wmax = w.max()
    if w.dtype == np.int64:
        if int(wmax) * n < _EXACT_LIMIT:
            return w
        w = w.astype(np.float64)
        wmax = w.max()
    elif float(wmax) * n < _EXACT_LIMIT and np.array_equal(w, np.floor(w)):
        return w.astype(np.int64)
    if wmax == 0:
        return np.zeros(n, dtype=np.int64)
    _, e = math.frexp(float(wmax))  # wmax < 2**e, so n * scaled max < 2**52
    shift = 52 - e - n.bit_length()
    return np.floor(np.ldexp(w, shift)).astype(np.int64)


def _sort_desc(q: np.ndarray) -> np.ndarray:
    """Positions of `q` (int64, `n * max < 2**53`) by descending value, ties by index.

    Sorts unique packed keys, so the result does not depend on the sort algorithm.
    """
    n = q.shape[0]
    key = (q.max() - q) * n + np.arange(n, dtype=np.int64)
    key.sort()
    return key % n


# ----------------------------------------------------------------------------- bounds, metrics


def _subset_averages(prefix: np.ndarray, num_parts: int, c: int, exact: bool) -> np.ndarray:
    """[t - 1, k - 1]: average load of k parts holding the t largest samples and k c - t of the
    smallest (ceil(t / c) <= k <= t < W); +inf (int64 max) where (t, k) is not feasible."""
    n = prefix.shape[0] - 1
    tmax = min(num_parts - 1, _SUBSET_T_MAX)
    t = np.arange(1, tmax + 1)[:, None]
    kk = np.arange(1, tmax + 1)[None, :]
    ok = (kk <= t) & (kk * c >= t)
    load = prefix[t] + prefix[n] - prefix[n - np.where(ok, kk * c - t, 0)]
    if exact:
        return np.where(ok, -((-load) // kk), _INT64_MAX)
    return np.where(ok, load / kk, np.inf)


def _giants_from(avg: np.ndarray, ceil_mean: int) -> int:
    """The `t` of the largest subset bound when it beats the mean with `t` parts, else 0."""
    kmin = np.argmin(avg, axis=1)
    bound = avg[np.arange(avg.shape[0]), kmin]
    tb = int(np.argmax(bound))
    return tb + 1 if bound[tb] > ceil_mean and kmin[tb] == tb else 0


def _bound_terms(v: np.ndarray, num_parts: int, strong: bool, exact: bool):
    """(total, best combinatorial bound, giants) for `v` sorted descending.

    `exact` (int64 `v`): integer arithmetic, averages rounded up (part sums are integers).
    """
    n = v.shape[0]
    k_ = num_parts
    c = n // k_
    prefix = np.zeros(n + 1, dtype=v.dtype)
    np.cumsum(v, out=prefix[1:])
    total = prefix[n]
    if c == 0:
        return total, 0, 0
    small = lambda x: total - prefix[n - x]  # sum of the x smallest samples

    # pigeonhole: some part holds j + 1 of the m = j W + 1 largest; its c - j - 1 others weigh
    # at least the smallest ones, which are never among the m largest (n - m >= c - j - 1).
    j = np.arange(c)
    m = j * k_ + 1
    best = (prefix[m] - prefix[m - j - 1] + small(c - j - 1)).max()
    if not strong or c < 2 or k_ < 2:
        return total, best, 0

    # subset: the k parts holding the t largest contain those t and k c - t others, so the
    # heaviest of them weighs at least their average.
    avg = _subset_averages(prefix, k_, c, exact)
    best = max(best, avg.min(axis=1).max())
    giants = _giants_from(avg, -(-int(total) // k_)) if exact else 0

    # pairing: the t <= W largest either share a part (two of them + c - 2 others), or sit in t
    # distinct parts whose t (c - 1) other samples include one >= v[n - t (c - 1)].
    t = np.arange(1, k_ + 1)
    apart = v[t - 1] + v[n - t * (c - 1)]
    share = np.concatenate([apart[:1], v[t[1:] - 2] + v[t[1:] - 1]])
    best = max(best, np.minimum(apart, share).max() + small(c - 2))
    return total, best, giants


def _exact_lower_bound(v: np.ndarray, num_parts: int) -> tuple[int, int]:
    """(lower bound, giants at the top level) for exact int64 `v` sorted descending."""
    total, best, giants = _bound_terms(v, num_parts, strong=True, exact=True)
    return max(-(-int(total) // num_parts), int(best)), giants


def lower_bound(workloads, num_parts: int, *, strong: bool = True) -> float:
    """Lower bound on the largest part sum of any equal-size partition into `num_parts` parts.

    With `c = n // W` samples per part and `w` sorted descending, the basic bound is::

        max(total / W, max_j [ sum(w[m - j - 1 : m]) + sum of the c - j - 1 smallest ])

    over `j = 0 .. c - 1`, `m = j * W + 1`: by pigeonhole some part holds `j + 1` of the `m`
    largest samples, and its other `c - j - 1` samples weigh at least the smallest ones (which
    are never among the `m` largest, since `n - m >= c - j - 1`).

    With `strong=True` (default) two more valid bounds are included; they matter when a few
    samples dominate or `c` is small:

    * subset: the `k` parts that hold the `t < W` largest samples contain those `t` samples and
      `k c - t` others, so `max >= min over ceil(t / c) <= k <= t of (top t + k c - t smallest)
      / k` (averages rounded up for integer workloads);
    * pairing: the `t <= W` largest either share a part (bound: `w[t-2] + w[t-1]` plus the
      `c - 2` smallest) or sit in `t` distinct parts, whose `t (c - 1)` other samples include
      one `>= w[n - t (c - 1)]` (bound: `w[t-1] + w[n - t (c - 1)]` plus the `c - 2` smallest);
      the smaller of the two holds. For `c = 2` this is the exact optimum
      `max_i w[i] + w[n - 1 - i]`.
    """
    num_parts = _check_num_parts(num_parts)
    w = _as_workloads(workloads)
    n = w.shape[0]
    _check_divisible(n, num_parts)
    if n == 0:
        return 0.0
    v = -np.sort(-w)
    if v.dtype == np.int64 and int(v[0]) * n < 2**62:
        total, best, _ = _bound_terms(v, num_parts, strong, exact=True)
        return float(max(int(total) / num_parts, int(best)))
    total, best, _ = _bound_terms(v.astype(np.float64), num_parts, strong, exact=False)
    return float(max(total / num_parts, best))


def part_sums(workloads, parts) -> np.ndarray:
    """Sum of the workloads of every part: int64 for integer workloads whose sums fit in int64,
    else float64 (correctly rounded, `math.fsum`)."""
    w = np.asarray(workloads)
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    if w.dtype.kind in "biu":
        w = w.astype(np.int64)
        if w.size == 0 or int(np.abs(w).max()) * w.size < 2**63:
            return np.array([int(w[p].sum()) for p in parts], dtype=np.int64)
        return np.array([float(sum(w[p].tolist())) for p in parts], dtype=np.float64)
    w = w.astype(np.float64)
    return np.array([math.fsum(w[p].tolist()) for p in parts], dtype=np.float64)


def imbalance(workloads, parts) -> float:
    """Largest part sum over the mean part sum: 1.0 is perfect balance (and a zero total)."""
    sums = part_sums(workloads, parts)
    if len(sums) == 0:
        return 1.0
    total = math.fsum(sums.tolist()) if sums.dtype.kind == "f" else float(int(sums.sum()))
    if total == 0:
        return 1.0
    return float(sums.max()) * len(sums) / total


# ----------------------------------------------------------------------------- constructions
# Constructions work on `v`, the exact integer workloads sorted descending (ties by index),
# and return `lab`, the part of every sorted position.


def _lpt(vals: np.ndarray, num_parts: int, capacity: int, start=None) -> list:
    """LPT with cardinality on `vals` (descending int64): each to the lightest part with room.

    `start` holds initial part sums. Ties go to the lower part id: the heap holds packed keys
    `sum * num_parts + part`, which order exactly like `(sum, part)`.
    """
    k_ = num_parts
    if start is None:
        heap = list(range(k_))
    else:
        heap = [int(s) * k_ + p for p, s in enumerate(start)]
        heapq.heapify(heap)
    room = [capacity] * k_
    out = []
    append = out.append
    replace, pop = heapq.heapreplace, heapq.heappop
    for x in (vals * k_).tolist():
        key = heap[0]
        p = key % k_
        append(p)
        r = room[p] - 1
        room[p] = r
        if r:
            replace(heap, key + x)
        else:
            pop(heap)
    return out


def _greedy_labels(v: np.ndarray, num_parts: int) -> np.ndarray:
    """LPT with cardinality: descending, each to the lightest part with room (ties: lower id)."""
    c = v.shape[0] // num_parts
    return np.array(_lpt(v, num_parts, c), dtype=np.int64)


def _kk_labels(v: np.ndarray, num_parts: int) -> np.ndarray:
    """Balanced largest differencing (sequential, heap ordered by spread, ties by age)."""
    n = v.shape[0]
    k_ = num_parts
    c = n // k_
    vals = v.tolist()
    heap = []
    for r in range(c):
        lo = r * k_
        sums = vals[lo : lo + k_]  # already descending
        members = [[lo + t] for t in range(k_)]
        heap.append((sums[-1] - sums[0], r, sums, members))
    heapq.heapify(heap)
    tick = c
    last = k_ - 1
    while len(heap) > 1:
        _, _, s1, m1 = heapq.heappop(heap)
        _, _, s2, m2 = heapq.heappop(heap)
        merged = [s1[t] + s2[last - t] for t in range(k_)]
        perm = sorted(range(k_), key=merged.__getitem__, reverse=True)  # stable
        members = []
        for t in perm:
            m = m1[t]
            m.extend(m2[last - t])
            members.append(m)
        sums = [merged[t] for t in perm]
        heapq.heappush(heap, (sums[-1] - sums[0], tick, sums, members))
        tick += 1
    lab = np.empty(n, dtype=np.int64)
    for p, m in enumerate(heap[0][3]):
        lab[m] = p
    return lab


def _giant_count(v: np.ndarray, num_parts: int) -> int:
    """Number `g` of leading samples that need the `g (c - 1)` smallest as companions: the `t`
    of the largest subset bound, if it beats the mean with the `t` samples apart; else 0."""
    n = v.shape[0]
    c = n // num_parts
    if c < 2 or num_parts < 2:
        return 0
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(v, out=prefix[1:])
    avg = _subset_averages(prefix, num_parts, c, exact=True)
    return _giants_from(avg, -(-int(prefix[n]) // num_parts))


def _construct_labels(v: np.ndarray, num_parts: int, giants: int) -> tuple[np.ndarray, int]:
    """Giants with the smallest samples, then LPT with cardinality on the rest. `giants` is the
    count at the top level (known from the bound). Returns (labels, total number of giants)."""
    n = v.shape[0]
    c = n // num_parts
    lab = np.empty(n, dtype=np.int64)
    lo, hi, base, left = 0, n, 0, num_parts
    low = v[-1]  # LPT on excesses over the smallest sample (same optimum, better LPT)
    g = giants
    for level in range(_GIANT_LEVELS):
        if level:
            g = _giant_count(v[lo:hi], left)
        if g == 0:
            break
        fill = hi - g * (c - 1)
        lab[lo : lo + g] = base + np.arange(g)
        if g == 1:
            lab[fill:hi] = base
        else:
            lab[fill:hi] = base + np.array(_lpt(v[fill:hi] - low, g, c - 1, v[lo : lo + g] - low))
        lo, hi, base, left = lo + g, fill, base + g, left - g
        if not left:
            break
    if left:
        lab[lo:hi] = base + np.array(_lpt(v[lo:hi] - low, left, c), dtype=np.int64)
    return lab, base


# ----------------------------------------------------------------------------- local search

_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}
_SENTINEL = 2**60  # beyond any value or part sum (< 2**53): never an improving exchange


def _pair_index(c: int) -> tuple[np.ndarray, np.ndarray]:
    if c not in _PAIRS:
        _PAIRS[c] = np.triu_indices(c, 1)
    return _PAIRS[c]


class _Parts:
    """Parts as rows: `pos` (sorted positions) and `val` (their values), ascending per row."""

    def __init__(self, v: np.ndarray, lab: np.ndarray, num_parts: int):
        n = v.shape[0]
        c = n // num_parts
        shift = n.bit_length()
        key = (lab << shift) | np.arange(n, dtype=np.int64)
        key.sort()
        # larger position = smaller value, so reversed rows are ascending
        self.pos = np.ascontiguousarray((key & ((1 << shift) - 1)).reshape(num_parts, c)[:, ::-1])
        self.val = v[self.pos]
        self.sums = self.val.sum(axis=1)
        self._shift = (c - 1).bit_length()
        self._cols = np.arange(c, dtype=np.int64)

    def labels(self) -> np.ndarray:
        k_, c = self.pos.shape
        lab = np.empty(k_ * c, dtype=np.int64)
        lab[self.pos.ravel()] = np.repeat(np.arange(k_, dtype=np.int64), c)
        return lab

    def resort(self, rows) -> None:
        """Sort the given rows ascending again (ties by column: unique packed keys)."""
        key = (self.val[rows] << self._shift) | self._cols
        key.sort(axis=1)
        col = key & ((1 << self._shift) - 1)
        self.pos[rows] = np.take_along_axis(self.pos[rows], col, axis=1)
        self.val[rows] = key >> self._shift

    def swap(self, h: int, q: int, hcols, qcols) -> None:
        for a, b in zip(hcols, qcols):
            self.val[h, a], self.val[q, b] = self.val[q, b], self.val[h, a]
            self.pos[h, a], self.pos[q, b] = self.pos[q, b], self.pos[h, a]
        self.sums[h] = self.val[h].sum()
        self.sums[q] = self.val[q].sum()
        self.resort([h, q])


def _best_exchange(hs: np.ndarray, cand: np.ndarray, sh: int, sums: np.ndarray):
    """Best exchange of one element of `hs` (sorted) against one element of a row of `cand`.

    Minimises max(sh - d, sums[r] + d), d = hs[i] - cand[r, j], over all (r, j) and the two
    `hs` neighbours of the ideal d = (sh - sums[r]) / 2. Returns (value, r, j, i); ties go to
    the first (r, j).
    """
    c = hs.shape[0]
    padded = np.empty(c + 2, dtype=np.int64)
    padded[0] = -_SENTINEL
    padded[1:-1] = hs
    padded[-1] = _SENTINEL
    half = (sh - sums) // 2
    p = np.searchsorted(padded, cand + half[:, None])  # in [1, c + 1]
    col = sums[:, None]
    d_lo = padded[p - 1] - cand
    d_hi = padded[p] - cand
    new_lo = np.maximum(sh - d_lo, col + d_lo)
    new_hi = np.maximum(sh - d_hi, col + d_hi)
    use_hi = new_hi < new_lo
    best = np.where(use_hi, new_hi, new_lo)
    f = int(np.argmin(best))
    r, j = divmod(f, cand.shape[1])
    i = int(p[r, j]) - (1 if use_hi[r, j] else 2)
    return int(best[r, j]), r, j, i


def _local_search(parts: _Parts, target: int, budget: int) -> bool:
    """Exchanges that lower the heaviest part until `target`; True when it is reached.

    Each step takes the best one-for-one exchange between the heaviest part and any other part
    (the lightest few are searched first); when there is none and `c <= 32`, the best
    two-for-two exchange. `budget` caps the candidate exchanges evaluated (deterministic).
    """
    k_, c = parts.val.shape
    few = max(1, min(k_ - 1, 512 // c))  # look at the lightest few parts first
    if 2 <= c <= _MAX_C_PAIRS:
        a, b = _pair_index(c)
        few2 = max(1, min(k_ - 1, 4096 // a.shape[0]))
    else:
        a = None
    while budget > 0:
        sums = parts.sums
        h = int(np.argmax(sums))
        sh = int(sums[h])
        if sh <= target:
            return True
        others = np.argsort(sums, kind="stable")
        others = others[others != h]
        hs = parts.val[h]
        found = False
        for rows in (others[:few], others[few:]):
            if rows.size and not found:
                budget -= rows.size * c
                value, r, j, i = _best_exchange(hs, parts.val[rows], sh, sums[rows])
                if value < sh:
                    parts.swap(h, int(rows[r]), (i,), (j,))
                    found = True
        if found:
            continue
        if a is None:
            return False
        hp = hs[a] + hs[b]
        o = np.argsort(hp, kind="stable")
        for rows in (others[:few2], others[few2:]):
            if rows.size and not found and budget > 0:
                budget -= rows.size * a.shape[0]
                cand = parts.val[rows]
                value, r, j, i = _best_exchange(hp[o], cand[:, a] + cand[:, b], sh, sums[rows])
                if value < sh:
                    i = int(o[i])
                    hcols = (int(a[i]), int(b[i]))
                    parts.swap(h, int(rows[r]), hcols, (int(a[j]), int(b[j])))
                    found = True
        if not found:
            return False
    return int(parts.sums.max()) <= target


def _auto_labels(v: np.ndarray, num_parts: int) -> np.ndarray:
    n = v.shape[0]
    lb, giants = _exact_lower_bound(v, num_parts)
    small = n <= _SMALL_N
    target = lb if small else lb + int(lb * _REL_TOL)
    budget = _SEARCH_BUDGET * n
    lab, giants = _construct_labels(v, num_parts, giants)
    # part sums are integers below 2**53, hence exact in float64
    if np.bincount(lab, weights=v, minlength=num_parts).max() <= target:
        return lab
    parts = _Parts(v, lab, num_parts)
    if _local_search(parts, target, budget):
        return parts.labels()
    best, best_max = parts.labels(), int(parts.sums.max())
    if not small and best_max <= lb + int(lb * _RETRY_EXCESS):
        return best
    for make in (_kk_labels, _greedy_labels):
        lab = make(v, num_parts)
        if np.bincount(lab, weights=v, minlength=num_parts).max() >= best_max:
            continue  # refine only starts that are better already
        parts = _Parts(v, lab, num_parts)
        _local_search(parts, target, budget)
        if int(parts.sums.max()) < best_max:
            best, best_max = parts.labels(), int(parts.sums.max())
    return best


# ----------------------------------------------------------------------------- public entry


def partition(workloads, num_parts: int, method: str = "auto") -> list[np.ndarray]:
    """Split the samples into `num_parts` parts of exactly `len(workloads) // num_parts` each.

    Returns one int64 array of sample indices per part, sorted ascending; every index appears
    exactly once. Deterministic: the same workloads (int or float dtype alike, for integral
    values) give the same parts on every machine. Raises `HSTUError` for a length not divisible
    by `num_parts`, `num_parts < 1`, negative or non-finite workloads, or an unknown method.
    """
    num_parts = _check_num_parts(num_parts)
    if not isinstance(method, str) or method not in METHODS:
        raise HSTUError(f"method must be one of {list(METHODS)}, got {method!r}")
    w = _as_workloads(workloads)
    n = w.shape[0]
    c = _check_divisible(n, num_parts)
    if c == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(num_parts)]
    q = _to_exact_int(w)
    order = _sort_desc(q)
    v = q[order]
    if num_parts == 1 or c == 1:
        lab = np.arange(n, dtype=np.int64) % num_parts
    elif method == "kk":
        lab = _kk_labels(v, num_parts)
    elif method == "greedy":
        lab = _greedy_labels(v, num_parts)
    else:
        lab = _auto_labels(v, num_parts)
    key = np.empty(n, dtype=np.int64)
    key[order] = lab * n
    key += np.arange(n, dtype=np.int64)
    key.sort()
    return list((key % n).reshape(num_parts, c))
