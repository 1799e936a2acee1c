"""mpidp: domain parallelism for PyTorch models on latitude bands, launched by MPI."""

from mpidp.bootstrap import LaunchInfo, detect_launch
from mpidp.errors import BackendError, CommError, ConfigError, LaunchError, MpidpError
from mpidp.manager import DistributedManager, Neighbors, get_manager, init, is_initialized

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "CommError",
    "ConfigError",
    "DistributedManager",
    "LaunchError",
    "LaunchInfo",
    "MpidpError",
    "Neighbors",
    "__version__",
    "detect_launch",
    "get_manager",
    "init",
    "is_initialized",
]
