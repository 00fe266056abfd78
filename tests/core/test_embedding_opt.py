"""The sharded tables' optimizer reference (hstu/embedding_opt.py), against the formulas of
docs/MODEL.md written out per element in float64, and its touched-rows semantics."""

from __future__ import annotations

import numpy as np
import pytest

from hstu import embedding_opt
from hstu.config import EmbeddingConfig, load_config
from hstu.errors import HSTUError
from hstu.testing import DEMO_CONFIG


def _cfg(**kw) -> EmbeddingConfig:
    return EmbeddingConfig(lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95, weight_decay=0.01, **kw)


def _steps(rng, rows=7, dim=4, steps=3):
    """Per step: distinct touched ids (never row 6) and their gradients."""
    out = []
    for _ in range(steps):
        ids = np.sort(rng.choice(6, size=3, replace=False))
        out.append((ids, rng.normal(size=(3, dim)).astype(np.float32)))
    return out


def test_row_wise_adagrad_matches_the_formula_and_leaves_untouched_rows(rng):
    cfg, table = _cfg(), rng.normal(size=(7, 4)).astype(np.float32)
    state = embedding_opt.init_state("row_wise_adagrad", 7, 4)
    w, s = table.astype(np.float64), np.zeros(7)
    for ids, g in _steps(rng):
        table, state = embedding_opt.apply("row_wise_adagrad", state, table, ids, g, cfg)
        for i, r in enumerate(ids):
            s[r] += np.mean(g[i].astype(np.float64) ** 2)
            w[r] -= cfg.lr * g[i] / (np.sqrt(s[r]) + cfg.eps)
    np.testing.assert_allclose(table, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["sum"], s, rtol=1e-5)
    assert state["count"] == 3 and state["sum"][6] == 0


def test_adam_matches_the_formula_bias_correction_counts_every_step(rng):
    cfg, table = _cfg(), rng.normal(size=(7, 4)).astype(np.float32)
    state = embedding_opt.init_state("adam", 7, 4)
    w, m, v = table.astype(np.float64), np.zeros((7, 4)), np.zeros((7, 4))
    for t, (ids, g) in enumerate(_steps(rng), start=1):
        table, state = embedding_opt.apply("adam", state, table, ids, g, cfg)
        for i, r in enumerate(ids):
            m[r] = cfg.beta1 * m[r] + (1 - cfg.beta1) * g[i]
            v[r] = cfg.beta2 * v[r] + (1 - cfg.beta2) * g[i] ** 2
            m_hat, v_hat = m[r] / (1 - cfg.beta1**t), v[r] / (1 - cfg.beta2**t)
            w[r] -= cfg.lr * (m_hat / (np.sqrt(v_hat) + cfg.eps) + cfg.weight_decay * w[r])
    np.testing.assert_allclose(table, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["m"], m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["v"], v, rtol=1e-5, atol=1e-8)
    assert state["count"] == 3
    # an untouched row keeps its weight (no weight decay) and zero moments
    assert np.all(state["m"][6] == 0) and np.all(table[6] == w[6])


def test_a_step_without_ids_changes_no_row_but_counts(rng):
    table = rng.normal(size=(5, 3)).astype(np.float32)
    for opt in embedding_opt.OPTIMIZERS:
        state = embedding_opt.init_state(opt, 5, 3)
        empty = np.zeros((0, 3), np.float32)
        new, state = embedding_opt.apply(opt, state, table, np.zeros(0, np.int64), empty, _cfg())
        np.testing.assert_array_equal(new, table)
        assert state["count"] == 1


def test_row_gradients_sum_every_lookup(rng):
    ids = np.array([3, 1, 3, 3, 0])
    g = rng.normal(size=(5, 2)).astype(np.float32)
    rows, g_r = embedding_opt.row_gradients(ids, g)
    np.testing.assert_array_equal(rows, [0, 1, 3])
    np.testing.assert_allclose(g_r, [g[4], g[1], g[0] + g[2] + g[3]], rtol=1e-6)


def test_inputs_are_not_modified_and_bad_ids_are_errors(rng):
    table = rng.normal(size=(4, 2)).astype(np.float32)
    state = embedding_opt.init_state("row_wise_adagrad", 4, 2)
    before = table.copy()
    embedding_opt.apply("row_wise_adagrad", state, table, [1], np.ones((1, 2)), _cfg())
    np.testing.assert_array_equal(table, before)
    assert np.all(state["sum"] == 0) and state["count"] == 0
    with pytest.raises(HSTUError, match="distinct"):
        embedding_opt.apply("row_wise_adagrad", state, table, [1, 1], np.ones((2, 2)), _cfg())
    with pytest.raises(HSTUError, match="outside"):
        embedding_opt.apply("row_wise_adagrad", state, table, [4], np.ones((1, 2)), _cfg())
    with pytest.raises(HSTUError, match="embedding.optimizer"):
        embedding_opt.init_state("sgd", 4, 2)


def test_row_wise_adagrad_with_weight_decay_is_a_config_error():
    with pytest.raises(HSTUError, match="embedding.weight_decay"):
        load_config(DEMO_CONFIG, ["embedding.sharding=row_wise", "embedding.weight_decay=0.1"])
    load_config(DEMO_CONFIG, ["embedding.optimizer=adam", "embedding.weight_decay=0.1"])
