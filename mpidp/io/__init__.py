"""Sharded I/O: each rank reads only its band (HDF5/netCDF-4, or Zarr with ``mpidp[zarr]``),
writes that xarray opens, checkpoints that load at any layout, and a built-in sample data set.
See docs/io.md."""

from mpidp.io.checkpoint import load_checkpoint, save_checkpoint
from mpidp.io.prefetch import Prefetcher
from mpidp.io.reader import DataParallelSampler, ShardedH5Dataset
from mpidp.io.rollout import RolloutWriter
from mpidp.io.sample import ensure_sample_data, make_sample_data
from mpidp.io.writer import parallel_hdf5_available, write_sharded
from mpidp.io.zarr_reader import ShardedZarrDataset, zarr_available

__all__ = [
    "DataParallelSampler",
    "Prefetcher",
    "RolloutWriter",
    "ShardedH5Dataset",
    "ShardedZarrDataset",
    "load_checkpoint",
    "make_sample_data",
    "ensure_sample_data",
    "parallel_hdf5_available",
    "save_checkpoint",
    "write_sharded",
    "zarr_available",
]
