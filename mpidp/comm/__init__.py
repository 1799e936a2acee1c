"""Transports: one interface (:class:`Transport`), two implementations.

``MPITransport`` (mpi4py, CPU tensors, zero copy) and ``TorchTransport`` (torch.distributed:
NCCL on GPU, gloo as CPU fallback). The MPI one is imported lazily so that importing mpidp does
not initialise MPI.
"""

from mpidp.comm.base import REDUCE_OPS, PendingExchange, Transport
from mpidp.comm.torchdist import TorchTransport

__all__ = ["PendingExchange", "Transport", "TorchTransport", "REDUCE_OPS"]
