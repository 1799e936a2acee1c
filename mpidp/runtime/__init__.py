"""The runtime every rank starts from: the launch it was started by (bootstrap), the manager
of its process groups and their transports (manager, adopt) and the steps of building one (the
MPI world and rank numbering: world; what the ranks must agree on: agree; backend and device:
device; the oversubscription warning: oversubscribed), how a length is cut over ranks
(partition), random streams that stay in step (rng), progress lines (progress)."""

from mpidp import _moved


def __getattr__(name: str) -> object:
    """A submodule on first use (``mpidp.ops.fft.rfft2`` after a plain ``import mpidp``)."""
    return _moved.submodule(__name__, name)
