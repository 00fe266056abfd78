"""HSTU-Balance: workload-balanced data-parallel training for HSTU generative recommenders.

The top-level package is the backend-neutral core (numpy + stdlib only). Backends live in
`hstu.torch_backend` and `hstu.jax_backend` and are imported lazily through `hstu.backends`.
"""

from hstu.errors import HSTUError

__version__ = "0.1.0"
__all__ = ["HSTUError", "__version__"]
