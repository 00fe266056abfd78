"""This backend's `hstu.eval_loop.Scorer`: the model in eval mode, under `torch.no_grad`.

In training it wraps the live model (the logging rank's replica); `from_params` builds one for
`hstu eval` from core-named parameters. Switching to eval mode turns dropout off, so no torch
RNG is drawn: the training streams are untouched. The model is put back in the mode it was in.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from hstu.batch import JaggedBatch
from hstu.torch_backend.batch import to_torch
from hstu.torch_backend.model import HSTUModel


class TorchEvaluator:
    def __init__(self, model: HSTUModel, device: torch.device | str):
        self.model, self.device = model, torch.device(device)

    @contextlib.contextmanager
    def _eval_mode(self):
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _batch(self, batch: JaggedBatch):
        tb = to_torch(batch).to(self.device)
        return tb.strip_padding() if tb.actual_batch_size else tb

    def query_embeddings(self, batch: JaggedBatch) -> np.ndarray:
        with self._eval_mode():
            return self.model.query_embeddings(self._batch(batch)).cpu().numpy()

    def item_embeddings(self) -> np.ndarray:
        with self._eval_mode():
            return self.model.item_embeddings().cpu().numpy()

    def candidate_logits(self, batch: JaggedBatch) -> np.ndarray:
        with self._eval_mode():
            return self.model.candidate_logits(self._batch(batch)).float().cpu().numpy()

    def export_params(self) -> dict[str, np.ndarray]:
        return self.model.export_params()

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        self.model.load_params(params)


def from_params(cfg, params: dict[str, np.ndarray], device: str = "auto") -> TorchEvaluator:
    """A scorer of `cfg.model` holding `params` (core names), on `device` (`dist.device`)."""
    import logging

    from hstu.torch_backend.launch import resolve_device

    # TorchRec's modules trip a one-time torch.fx deprecation notice: noise here.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    device = torch.device(resolve_device(device, 1))
    model = HSTUModel(cfg.model, device)
    model.load_params(params)
    return TorchEvaluator(model, device)
