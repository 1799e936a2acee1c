"""Operations on bands, built on the runtime: collectives (v-collectives and their autograd
forms), the halo exchange and its plan, window geometry, the distributed FFT, attention over
cut sequences, training helpers, forecast skill, and cutting/joining whole tensors (sharding)."""

from mpidp import _moved


def __getattr__(name: str) -> object:
    """A submodule on first use (``mpidp.ops.fft.rfft2`` after a plain ``import mpidp``)."""
    return _moved.submodule(__name__, name)
