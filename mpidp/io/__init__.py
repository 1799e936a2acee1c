"""HDF5-backed sharded I/O: each rank reads only its band, writes that xarray opens,
checkpoints that load at any layout, and a built-in sample data set. See docs/io.md."""

from mpidp.io.checkpoint import load_checkpoint, save_checkpoint
from mpidp.io.reader import DataParallelSampler, ShardedH5Dataset
from mpidp.io.sample import ensure_sample_data, make_sample_data
from mpidp.io.writer import RolloutWriter, parallel_hdf5_available, write_sharded

__all__ = [
    "DataParallelSampler",
    "RolloutWriter",
    "ShardedH5Dataset",
    "load_checkpoint",
    "make_sample_data",
    "ensure_sample_data",
    "parallel_hdf5_available",
    "save_checkpoint",
    "write_sharded",
]
