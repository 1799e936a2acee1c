"""anemoi's ``anemoi.models.distributed.utils``."""

from __future__ import annotations

import torch

__all__ = ["get_memory_format"]


def get_memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """``torch.channels_last`` when ``tensor`` is contiguous in that format, else
    ``torch.contiguous_format`` (anemoi's rule). Local."""
    if tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
