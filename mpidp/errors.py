"""Exceptions raised by mpidp.

Every message says what was found (the values), where (the rank, when known) and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "MpidpError",
    "LaunchError",
    "ConfigError",
    "BackendError",
    "CommError",
    "DataError",
    "OversubscribedWarning",
]


class MpidpError(RuntimeError):
    """Base class of every error mpidp raises on purpose."""


class LaunchError(MpidpError):
    """The launcher environment is inconsistent or unsupported."""


class ConfigError(MpidpError, ValueError):
    """Arguments that cannot describe a valid distributed layout."""


class BackendError(MpidpError):
    """A requested communication backend or device is not available."""


class CommError(MpidpError, ValueError):
    """Arguments of a collective that cannot be satisfied (sizes, shapes, dtypes)."""


class DataError(MpidpError, ValueError):
    """A data file that cannot be read or written as asked: missing, corrupt, of the wrong
    layout, or different between ranks."""


class OversubscribedWarning(UserWarning):
    """A node runs more ranks than it has cores: the ranks time-share the cores. Rank 0 warns
    once per process; filter this category (or set ``MPIDP_WARN_OVERSUBSCRIBED=0``) where the
    oversubscription is on purpose."""
