"""The runtime every rank starts from: the launch it was started by (bootstrap), the manager
of its process groups and their transports (manager, adopt), how a length is cut over ranks
(partition), random streams that stay in step (rng), progress lines (progress)."""

import importlib as _importlib


def __getattr__(name: str) -> object:
    """A submodule on first use (``mpidp.ops.fft.rfft2`` after a plain ``import mpidp``)."""
    if not name.startswith("_"):
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # the submodule exists; something it imports not
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
