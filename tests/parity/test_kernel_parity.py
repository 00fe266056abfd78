"""HSTU attention: the Triton kernel, the Pallas kernel and both references on the same random
inputs, forward and gradients (q, k, v and the bias tables), for every mask feature alone and
all together. Every implementation must agree with every other one.

On CPU both kernels run interpreted (TRITON_INTERPRET=1 must be set before triton is imported,
so the four implementations run in a fresh process); the gpu-marked variant compiles them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("jax")

from parity_workers import (  # noqa: E402
    KERNEL_CASES,
    KERNEL_OUTPUTS,
    jax_test_env,
    run_subprocess_worker,
)

IMPLS = ("triton", "pallas", "triton_reference", "pallas_reference")
# max |a - b| / max |b|: fp32 everywhere; gradients of the bias tables sum many terms.
TOL = {"interpret": {"out": 1e-5, "grad": 1e-4}, "gpu": {"out": 1e-4, "grad": 1e-3}}


def _errors(case_result: dict) -> dict[tuple[str, str, str], float]:
    errs = {}
    for a, b in itertools.combinations(IMPLS, 2):
        for name in KERNEL_OUTPUTS:
            if name in case_result[b]:
                x, y = case_result[a][name], case_result[b][name]
                assert x.shape == y.shape, (a, b, name)
                errs[(a, b, name)] = float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))
    return errs


def _check(results: dict, mode: str) -> None:
    assert set(results) == set(KERNEL_CASES)
    failures = []
    for case, res in results.items():
        total = res["total"]
        for impl in IMPLS:
            assert not np.any(res[impl]["out"][total:]), f"{case} {impl}: padding rows"
        for (a, b, name), err in _errors(res).items():
            tol = TOL[mode]["out" if name == "out" else "grad"]
            if not err <= tol:
                failures.append(f"{case}: {a} vs {b} {name}: {err:.2e} > {tol:.0e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow  # ~25 s interpreted on 2 cores; CI runs the slow tier after `make test`
def test_triton_pallas_and_references_agree_interpret():
    env = jax_test_env() | {"TRITON_INTERPRET": "1"}
    _check(run_subprocess_worker("kernels", env, mode="interpret"), "interpret")


@pytest.mark.gpu
def test_triton_pallas_and_references_agree_gpu():
    # Both frameworks share the GPU: JAX must not preallocate most of its memory.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TRITON_INTERPRET": "0"}
    _check(run_subprocess_worker("kernels", env, mode="gpu"), "gpu")
