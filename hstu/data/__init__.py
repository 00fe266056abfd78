"""Data: sequence-length distributions and the seeded synthetic HSTU dataset."""

from hstu.data.distributions import DISTRIBUTIONS, sample_lengths
from hstu.data.synthetic import SampleSpec, SyntheticDataset, dataset_from_config, make_sample

__all__ = [
    "DISTRIBUTIONS",
    "SampleSpec",
    "SyntheticDataset",
    "dataset_from_config",
    "make_sample",
    "sample_lengths",
]
