"""4 host devices: the JAX allgather and all2all exchanges equal `exchange_reference` byte for
byte (full, incomplete, a rank with no real sample, all padding; balanced, identity, random and
everyone-moves plans), and each uses two collectives whatever the number of keys."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from jax_workers import run_worker  # noqa: E402

from hstu.testing import EXCHANGE_CASES  # noqa: E402

CASES = list(EXCHANGE_CASES)


@pytest.mark.multirank
def test_exchanges_equal_reference_byte_for_byte():
    out = run_worker("exchange", devices=4, cases=CASES)
    assert out["failures"] == []
    assert len(out["info"]) == 4 * len(CASES)
    moved = {(i["case"], i["plan"]): i["moved"] for i in out["info"]}
    assert moved[(0, "identity")] == 0 and moved[(0, "reverse")] == 24
    assert moved[(3, "balanced")] == 0  # all padding: nothing to move
    for kind, counts in out["collectives"].items():  # 12 keys, still 2 collectives
        expected = {
            "allgather": {"all_gather": 2, "all_to_all": 0},
            "all2all": {"all_gather": 0, "all_to_all": 2},
        }[kind]
        assert counts == expected, (kind, counts)
