"""Operations on bands, built on the runtime: collectives (v-collectives and their autograd
forms), the halo exchange and its plan, window geometry, the distributed FFT, attention over
cut sequences, training helpers, forecast skill, and cutting/joining whole tensors (sharding)."""

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
