"""Which torch.distributed backend and device a rank uses: NCCL and ``cuda:(local_rank mod
visible devices)`` when CUDA is available, else gloo and the CPU; an explicit choice wins and is
checked against what this torch build and this node offer."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mpidp.errors import BackendError

__all__ = ["BACKENDS", "choose_device"]

BACKENDS = ("gloo", "nccl", "mpi")


def choose_device(
    rank: int, local_rank: int, backend: str | None, device: str | torch.device | None
) -> tuple[str, torch.device]:
    """The backend and device of global rank ``rank`` (``local_rank`` on its node)."""
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if not dist.is_backend_available(backend):
        raise BackendError(
            f"rank {rank}: torch.distributed backend {backend!r} is not available in "
            f"this torch build ({torch.__version__}); use backend='gloo' or leave it unset"
        )
    if backend == "nccl" and not cuda:
        raise BackendError(
            f"rank {rank}: backend 'nccl' needs CUDA but torch sees no GPU; use "
            f"backend='gloo' or run on a GPU node"
        )
    if device is None:
        dev = (
            torch.device("cuda", local_rank % torch.cuda.device_count())
            if (backend == "nccl")
            else torch.device("cpu")
        )
    else:
        dev = torch.device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if cuda else 0
        index = dev.index if dev.index is not None else local_rank % max(count, 1)
        if index >= count:
            raise BackendError(
                f"rank {rank}: device cuda:{index} but {count} CUDA devices are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"pick an index below {count} or leave device unset"
            )
        dev = torch.device("cuda", index)
    return backend, dev
