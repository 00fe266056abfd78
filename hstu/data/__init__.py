"""Data: sequence-length distributions, the seeded synthetic HSTU dataset, prepared datasets
(`hstu data prepare`) and the source a config names (`source_from_config`)."""

from hstu.data.distributions import DISTRIBUTIONS, sample_lengths
from hstu.data.loader import DataLoader, batch_ranges
from hstu.data.manifest import Manifest
from hstu.data.prepare import DATASETS, prepare
from hstu.data.prepared import PreparedDataset, PreparedSpec
from hstu.data.sources import source_from_config
from hstu.data.synthetic import (
    SampleSpec,
    SyntheticDataset,
    SyntheticSamples,
    dataset_from_config,
    make_sample,
)

__all__ = [
    "DATASETS",
    "Manifest",
    "PreparedDataset",
    "PreparedSpec",
    "prepare",
    "DISTRIBUTIONS",
    "DataLoader",
    "SyntheticSamples",
    "batch_ranges",
    "source_from_config",
    "SampleSpec",
    "SyntheticDataset",
    "dataset_from_config",
    "make_sample",
    "sample_lengths",
]
