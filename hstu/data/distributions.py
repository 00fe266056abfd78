"""Sequence-length distributions for synthetic data and benchmarks.

Every distribution draws integer lengths in `[min_len, max_len]` from a numpy Generator, so
a seed fixes the draw on every machine.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping

import numpy as np

from hstu.errors import HSTUError


def _clip(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def uniform(rng, n, lo, hi, **_):
    return rng.integers(lo, hi + 1, size=n, dtype=np.int64)


def normal(rng, n, lo, hi, mean=None, std=None, **_):
    mean = (lo + hi) / 2 if mean is None else mean
    std = (hi - lo) / 6 if std is None else std
    return _clip(rng.normal(mean, std, size=n), lo, hi)


def lognormal(rng, n, lo, hi, sigma=1.0, median=None, **_):
    median = max(lo, (hi - lo) / 8) if median is None else median
    return _clip(rng.lognormal(np.log(max(median, 1)), sigma, size=n), lo, hi)


def zipf(rng, n, lo, hi, a=1.2, **_):
    # Bounded Zipf over the support [lo, hi]: P(L = lo + k) ~ (k + 1)^-a, by inverse CDF.
    support = np.arange(1, hi - lo + 2, dtype=np.float64)
    cdf = np.cumsum(support**-a)
    cdf /= cdf[-1]
    return lo + np.searchsorted(cdf, rng.random(n), side="right").clip(0, hi - lo).astype(np.int64)


def pareto(rng, n, lo, hi, alpha=1.5, **_):
    return _clip(max(lo, 1) * (1 + rng.pareto(alpha, size=n)), lo, hi)


def fixed(rng, n, lo, hi, **_):
    return np.full(n, hi, dtype=np.int64)


DISTRIBUTIONS: dict[str, Callable[..., np.ndarray]] = {
    "uniform": uniform,
    "normal": normal,
    "lognormal": lognormal,
    "zipf": zipf,
    "pareto": pareto,
    "fixed": fixed,
}


def accepted_params(name: str) -> tuple[str, ...]:
    """The keyword parameters distribution `name` takes (read off its signature)."""
    sig = inspect.signature(DISTRIBUTIONS[name])
    return tuple(
        p.name for p in list(sig.parameters.values())[4:] if p.kind is p.POSITIONAL_OR_KEYWORD
    )


# Parameters that must be strictly positive where given (scale and shape parameters).
_POSITIVE = {"std", "sigma", "median", "a", "alpha"}


def check_params(name: str, params: Mapping, where: str = "seqlen_params") -> None:
    """Unknown keys and non-numeric or out-of-range values are errors naming the key."""
    if not isinstance(params, Mapping):
        raise HSTUError(f"config: {where} must be a mapping, got {params!r}")
    accepted = accepted_params(name)
    for key, value in params.items():
        if key not in accepted:
            raise HSTUError(
                f"config: unknown key '{where}.{key}' for seqlen_dist={name} "
                f"(accepted: {list(accepted) or 'none'}; {where} must match the distribution)"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HSTUError(f"config: {where}.{key} expects a number, got {value!r}")
        if not math.isfinite(value) or (key in _POSITIVE and value <= 0):
            raise HSTUError(f"config: {where}.{key}={value!r} is invalid: must be finite and > 0")


def sample_lengths(
    name: str, rng: np.random.Generator, n: int, min_len: int, max_len: int, **params
) -> np.ndarray:
    """`n` integer lengths in [min_len, max_len] from the named distribution."""
    if name not in DISTRIBUTIONS:
        raise HSTUError(f"seqlen_dist must be one of {sorted(DISTRIBUTIONS)}, got {name!r}")
    if not 0 <= min_len <= max_len:
        raise HSTUError(f"need 0 <= min_len <= max_len, got min_len={min_len} max_len={max_len}")
    return DISTRIBUTIONS[name](rng, n, min_len, max_len, **params)
