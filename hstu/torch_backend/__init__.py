"""The PyTorch + TorchRec backend: KJT batches, torch.distributed shuffle, HSTU model.

Files mirror `hstu/jax_backend/`: batch.py (JaggedBatch <-> KeyedJaggedTensor),
collectives.py (stats gather, fused allgather, all2all), shuffler.py (device side of the
pipeline's Backend), model.py, attention.py (reference | kernel switch), state.py (optimizer,
RNG streams), train_step.py (the trainer's Backend, `run_rank`), launch.py (`train(cfg)`:
starting the ranks), checkpoint.py
(training checkpoints through torch.distributed.checkpoint), convert.py (`hstu convert`),
sharding.py (`embedding.sharding`: TorchRec DMP over the tables, fused TBE optimizer).

Importing this package imports nothing heavy (as `hstu.jax_backend`): the names below load
their modules on first use, so a submodule that needs only torch (`bench_attention`: the
kernel benchmark) runs where TorchRec / fbgemm are not installed.
"""

import importlib

_EXPORTS = {
    "TorchBatch": "batch",
    "to_jagged": "batch",
    "to_torch": "batch",
    "train": "launch",
    "HSTUModel": "model",
    "TorchBackend": "train_step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
