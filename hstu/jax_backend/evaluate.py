"""This backend's `hstu.eval_loop.Scorer`: the model's scoring methods, jitted on one device.

In training it reads the live (replicated) parameters, one device's copy, taken once per
training step it is asked about; `from_params` builds one for `hstu eval` from core-named
parameters. `deterministic=True` (the methods' default) turns dropout off and no RNG key is
passed, so the training streams are untouched.

Shapes stay bounded: an evaluation batch is padded to a token capacity of
`bucket_capacity(..., fine=True)` (two sizes per octave), and evaluation batches of one run are
nearly all full, so each method compiles once or twice per run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hstu.batch import JaggedBatch
from hstu.jax_backend import batch as jb
from hstu.jax_backend.model import HSTUModel, flax_to_params, params_to_flax


def _fine(n: int) -> int:
    return jb.bucket_capacity(n, fine=True)


class JaxEvaluator:
    def __init__(
        self,
        model: HSTUModel,
        params_fn: Callable[[], Any],
        device: jax.Device,
        candidates_per_sample: int = 0,
    ):
        """`candidates_per_sample`: the bound on a sample's candidates (`jb.candidate_bound`)
        that sizes the candidate keys, as the training step's batches; 0: the token capacity."""
        self.model, self._params_fn, self.device = model, params_fn, device
        self.candidates_per_sample = candidates_per_sample
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self._source: Any = None  # the tree `_params` was copied from
        self._params: Any = None
        self._loaded: Any = None  # set by load_params: evaluated instead of params_fn's

        def method(fn):
            def call(params, batch):
                return model.apply({"params": params}, jb.local_view(batch), method=fn)

            return jax.jit(call)

        self._query = method(HSTUModel.query_embeddings)
        self._logits = method(HSTUModel.candidate_logits)
        self._items = jax.jit(
            lambda params: model.apply({"params": params}, method=HSTUModel.item_embeddings)
        )

    def params(self) -> Any:
        if self._loaded is not None:
            return self._loaded
        tree = self._params_fn()
        if tree is not self._source:  # a new training step: take one device's copy
            self._source = tree
            self._params = jax.tree.map(
                lambda x: jax.device_put(x.addressable_data(0), self.device), tree
            )
        return self._params

    def _device_batch(self, batch: JaggedBatch) -> jb.DeviceBatch:
        lengths = {k: np.asarray(batch.lengths[k])[None] for k in batch.keys}
        spec = jb.spec_for(batch, lengths, _fine, self.candidates_per_sample)
        return jb.to_device([batch], self._sharding, spec)

    def query_embeddings(self, batch: JaggedBatch) -> np.ndarray:
        out = self._query(self.params(), self._device_batch(batch))
        return np.asarray(out)[: batch.actual_batch_size]

    def item_embeddings(self) -> np.ndarray:
        return np.asarray(self._items(self.params()))

    def candidate_logits(self, batch: JaggedBatch) -> np.ndarray:
        out = self._logits(self.params(), self._device_batch(batch))
        return np.asarray(out)[: int(np.sum(batch.lengths["candidate"]))]

    def export_params(self) -> dict[str, np.ndarray]:
        return {k: np.array(v) for k, v in flax_to_params(jax.device_get(self.params())).items()}

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        self._loaded = jax.device_put(params_to_flax(params), self.device)


def from_params(cfg, params: dict[str, np.ndarray], device: str = "auto") -> JaxEvaluator:
    """A scorer of `cfg.model` holding `params` (core names), on the first device of
    `dist.device`."""
    from hstu.jax_backend.model import build_model

    platform = {"auto": None, "cpu": "cpu", "cuda": "gpu", "gpu": "gpu"}[device]
    first = (jax.devices(platform) if platform else jax.devices())[0]
    model = build_model(cfg.model, cfg.data.max_seqlen, interpret=first.platform == "cpu")
    evaluator = JaxEvaluator(model, lambda: None, first, jb.candidate_bound(cfg))
    evaluator.load_params(params)
    return evaluator
