"""Lazy backend registry: a torch-only user never imports jax, and the reverse.

A backend module exposes `train(cfg, source=None) -> list[dict]` (the per-step metrics on the
logging process), running the core trainer (`hstu.trainer`) with its primitives; `source` is a
`hstu.data.loader.SampleSource` (default: the one `cfg.data` describes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from hstu.errors import HSTUError

_REGISTRY: dict[str, tuple[str, str]] = {
    "torch": ("hstu.torch_backend.launch", "torch"),
    "jax": ("hstu.jax_backend.launch", "jax"),
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def check_names(requested: list[str], who: str) -> None:
    """An error naming the unknown ones, before anything runs (benchmarks' `--backends`)."""
    unknown = sorted(set(requested) - set(_REGISTRY))
    if unknown:
        raise HSTUError(f"{who}: unknown backend(s) {unknown}; choose from {names()}")


def available(name: str) -> tuple[bool, str]:
    """(True, "") when the backend imports; else (False, why)."""
    if name not in _REGISTRY:
        return False, f"unknown backend {name!r}; choose from {names()}"
    module, requirement = _REGISTRY[name]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or requirement
        if missing.startswith("hstu."):
            return False, f"backend {name!r} is not available yet in this build ({missing})"
        return False, (
            f"backend {name!r} needs the package {missing!r}; "
            f"run `make setup` (or pip install -e '.[{requirement}]')"
        )
    return True, ""


def get_train(name: str) -> Callable:
    ok, why = available(name)
    if not ok:
        raise HSTUError(why)
    return importlib.import_module(_REGISTRY[name][0]).train
