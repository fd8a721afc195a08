"""Deterministic, resumable, cached data loading that survives worker and node failures.

The pieces, lowest first:

* :mod:`~dataloader_cache.codec`: a safe (no pickle), checksummed batch format;
* :mod:`~dataloader_cache.sampler`: the batch of (epoch, step, dp_rank) as a pure function;
* :class:`NodeBatchCache`: collated batches in node-owned shared memory, outliving workers,
  within a size budget and a lookback window behind the committed step;
* :class:`EpochSampleCache`: preprocessed samples on local disk so later epochs skip
  preprocessing;
* :class:`CachedLoader`: the prefetching, resumable loader that ties them together.

This package is a lower layer: it never imports ``recovery``, ``launcher`` or
``replication``. The recovery runtime drives it through ``state_dict``/``load_state_dict``,
``seek`` and ``mark_committed``.
"""

from .codec import CorruptEntryError, decode, encode
from .config import DataloaderCacheConfig
from .epoch_cache import EpochSampleCache
from .fingerprint import dataset_fingerprint
from .loader import CachedLoader, default_job_id
from .node_cache import BatchKey, NodeBatchCache, default_root
from .sampler import DeterministicSampler
from .workers import WorkerError

__all__ = [
    "BatchKey",
    "CachedLoader",
    "CorruptEntryError",
    "DataloaderCacheConfig",
    "DeterministicSampler",
    "EpochSampleCache",
    "NodeBatchCache",
    "WorkerError",
    "dataset_fingerprint",
    "decode",
    "default_job_id",
    "default_root",
    "encode",
]
