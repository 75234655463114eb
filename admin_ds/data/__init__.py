"""Binarized corpora, batching and the resumable training-data iterator.

See :mod:`admin_ds.data.indexed` for the on-disk format and the collater, and
:mod:`admin_ds.data.batching` for token-budget batching and sharding.
"""

from admin_ds.data.batching import EpochBatchIterator, filter_by_size, make_token_batches
from admin_ds.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    ParallelDataset,
    collate,
    dtype_for_vocab,
)

__all__ = [
    "EpochBatchIterator",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "ParallelDataset",
    "collate",
    "dtype_for_vocab",
    "filter_by_size",
    "make_token_batches",
]
