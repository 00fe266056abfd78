"""The PyTorch + TorchRec backend: KJT batches, torch.distributed shuffle, HSTU model.

Files mirror `hstu/jax_backend/`: batch.py (JaggedBatch <-> KeyedJaggedTensor),
collectives.py (stats gather, fused allgather, all2all), shuffler.py (device side of the
pipeline's Backend), model.py, attention.py (reference | kernel switch), state.py (optimizer,
RNG streams), train_step.py (the trainer's Backend, `run_rank`), launch.py (`train(cfg)`:
starting the ranks), checkpoint.py
(training checkpoints through torch.distributed.checkpoint), convert.py (`hstu convert`),
sharding.py (`embedding.sharding`: TorchRec DMP over the tables, fused TBE optimizer).
"""

from hstu.torch_backend.batch import TorchBatch, to_jagged, to_torch
from hstu.torch_backend.launch import train
from hstu.torch_backend.model import HSTUModel
from hstu.torch_backend.train_step import TorchBackend

__all__ = ["HSTUModel", "TorchBackend", "TorchBatch", "to_jagged", "to_torch", "train"]
