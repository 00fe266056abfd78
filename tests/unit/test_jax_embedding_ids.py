"""The id bookkeeping of the JAX tables (`hstu/jax_backend/embedding.py`): distinct ids, cache
slots and per-row gradient sums, each computed through a map over the table's rows (tables of
at most `ROWS_PER_ID` rows per id) and by sorting the ids (larger tables), both held to numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hstu.jax_backend import embedding as emb

PATHS = ["map", "sort"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "sort":  # every table is "too large" for the map
        monkeypatch.setattr(emb, "ROWS_PER_ID", 0)
    return request.param


def _jit(f, **static):
    """`f` with `static` bound, compiled as one program (op-by-op dispatch compiles every
    primitive): a fresh function each call, so each path traces anew."""
    return jax.jit(lambda *args: f(*args, **static))


def _ids(rng, n: int, rows: int) -> np.ndarray:
    """Repeats, negatives and ids past the table among in-range ones."""
    ids = rng.integers(-3, rows + 3, size=n).astype(np.int32)
    ids[: n // 2] = rng.integers(0, max(rows // 3, 1), size=n // 2)  # many repeats
    return rng.permutation(ids)


@pytest.mark.parametrize("rows,n,size", [(50, 200, 51), (50, 200, 7), (1000, 64, 64), (3, 40, 4)])
def test_distinct_ids_are_the_smallest_in_range_values_then_the_fill(path, rows, n, size):
    rng = np.random.default_rng(rows + n + size)
    ids = _ids(rng, n, rows)
    assert emb._by_map(rows, n) == (path == "map")
    distinct = _jit(emb.distinct_ids, num_rows=rows, size=size, fill=rows + 5)
    got = np.asarray(distinct(jnp.asarray(ids)))
    want = np.unique(ids[(ids >= 0) & (ids < rows)])[:size]
    assert got.dtype == np.int32 and got.shape == (size,)
    np.testing.assert_array_equal(got[: want.size], want)
    assert (got[want.size :] == rows + 5).all()


def test_slot_map_places_each_cached_id_and_ignores_the_rest():
    cache = jnp.asarray([2, 5, 9, 12, 12], jnp.int32)  # 12: a sentinel past 10 rows
    got = np.asarray(_jit(emb.slot_map, num_rows=10)(cache))
    want = np.full(10, -1)
    want[[2, 5, 9]] = [0, 1, 2]
    np.testing.assert_array_equal(got, want)


def test_cached_lookup_reads_cached_rows_zero_for_missing_ids_and_nan_out_of_range(path):
    rows, rng = 40, np.random.default_rng(3)
    table = rng.normal(size=(rows, 4)).astype(np.float32)
    ids = _ids(rng, (6 * 7), rows).reshape(6, 7)  # any shape
    real = rng.random(ids.shape) < 0.8
    distinct = _jit(emb.distinct_ids, num_rows=rows, size=30, fill=rows)
    cache_ids = distinct(jnp.asarray(np.where(real, ids, rows)))
    cache_rows = jnp.asarray(
        np.where(
            (np.asarray(cache_ids) < rows)[:, None],
            table[np.minimum(np.asarray(cache_ids), rows - 1)],
            0.0,
        )
    )
    lookup = _jit(emb.cached_lookup, num_rows=rows)

    got = np.asarray(lookup(cache_ids, cache_rows, jnp.asarray(ids)))
    in_range = (ids >= 0) & (ids < rows)
    cached = np.isin(ids, np.asarray(cache_ids)) & in_range
    np.testing.assert_array_equal(got[cached], table[ids[cached]])
    assert (got[in_range & ~cached] == 0).all()
    assert np.isnan(got[~in_range]).all()
    # a lookup that reads no cached row reads no slot: past the cache, where its gradient
    # is dropped instead of added (zeros) onto some slot
    slots = np.asarray(_jit(emb.cache_slots, num_rows=rows)(cache_ids, jnp.asarray(ids)))
    order = {int(r): i for i, r in enumerate(np.asarray(cache_ids)) if r < rows}
    np.testing.assert_array_equal(slots[cached], [order[int(i)] for i in ids[cached]])
    assert (slots[~cached] == cache_ids.shape[0]).all()

    # the rows' gradient: each cached row collects the cotangents of its lookups
    cot = rng.normal(size=got.shape).astype(np.float32)
    weights = jnp.asarray(np.where(np.isnan(got), 0.0, cot))
    grad = jax.jit(jax.grad(lambda r: jnp.sum(lookup(cache_ids, r, jnp.asarray(ids)) * weights)))
    g = np.asarray(grad(cache_rows))
    want = np.zeros_like(g)
    slot = {int(r): i for i, r in enumerate(np.asarray(cache_ids)) if r < rows}
    for idx in zip(*np.nonzero(cached), strict=True):
        want[slot[int(ids[idx])]] += cot[idx]
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,n", [(30, 90), (1000, 50)])
def test_sum_by_row_sums_each_rows_gradients_and_leaves_the_fill_out(path, rows, n):
    rng = np.random.default_rng(rows)
    ids = _ids(rng, n, rows).reshape(3, -1) if n % 3 == 0 else _ids(rng, n, rows)
    grads = rng.normal(size=(*ids.shape, 5)).astype(np.float32)
    size = min(ids.size, rows + 1)
    sums = _jit(emb.sum_by_row, num_rows=rows, fill=rows, size=size)
    uniq, g = sums(jnp.asarray(ids), jnp.asarray(grads))
    uniq, g = np.asarray(uniq), np.asarray(g)

    flat, gflat = ids.reshape(-1), grads.reshape(-1, 5)
    ok = (flat >= 0) & (flat < rows)
    want_ids = np.unique(flat[ok])
    np.testing.assert_array_equal(uniq[: want_ids.size], want_ids)
    assert (uniq[want_ids.size :] == rows).all()
    want = np.zeros((size, 5), np.float32)
    for i, r in enumerate(want_ids):
        want[i] = gflat[flat == r].sum(axis=0)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
