"""Pre-flight: what a model will do on bands before a run (validate, explain, plan)."""

from mpidp import _moved


def __getattr__(name: str) -> object:
    """A submodule on first use (``mpidp.ops.fft.rfft2`` after a plain ``import mpidp``)."""
    return _moved.submodule(__name__, name)
