"""Random generators across the domain group.

The ranks of one domain group compute one sample together, so every random draw on a value
they all hold (dropout inside a position-bias MLP, a noise level, a random crop) must be the
same draw on every rank: their default generators must stay in step. mpidp never seeds them
(the user does, the same seed on every domain rank, different per data-parallel rank); it
keeps them in step and checks that they are:

* a random draw on a band (``F.dropout`` of a ShardedTensor, ``randn_like``) takes its rows
  from this rank's own stream, seeded by one draw of the default generator (the same draw on
  every rank), so the default generator advances alike whatever each band's size;
* :func:`check_in_step` compares a fingerprint of every rank's generator state and raises
  the same error on every rank when they differ, instead of training a model whose ranks
  drew different values. It runs where a model :func:`draws` (a module in training mode
  with dropout, drop path or RReLU): at each call of a converted model and in
  ``sync_gradients``. A model without such modules may leave the generators apart (each
  rank drawing its own band of random data is common); a random call written in a forward
  as a function on plain tensors (``F.dropout(t, p, self.training)``) is not seen.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from mpidp.errors import ConfigError

__all__ = ["band_stream", "check_in_step", "draws", "fingerprint"]

_MIX = 0x9E3779B97F4A7C15


def draws(model: nn.Module) -> bool:
    """Whether a module of ``model`` in training mode draws random numbers: dropout (a
    positive ``p``), drop path / stochastic depth (a positive ``drop_prob``), RReLU."""
    for mod in model.modules():
        if not mod.training:
            continue
        if isinstance(mod, nn.RReLU):
            return True
        p = mod.p if isinstance(mod, nn.modules.dropout._DropoutNd) else None
        p = getattr(mod, "drop_prob", None) if p is None else p
        if isinstance(p, int | float) and p > 0:
            return True
    return False


def fingerprint(device: torch.device | None = None) -> int:
    """A 31-bit digest of the default generator's state (the CPU one, and the device's)."""
    state = torch.get_rng_state().numpy().tobytes()
    if device is not None and device.type == "cuda":
        state += torch.cuda.get_rng_state(device).numpy().tobytes()
    return zlib.crc32(state) & 0x7FFFFFFF


@contextlib.contextmanager
def band_stream(rank: int, device: torch.device, draws: bool = True) -> Iterator[None]:
    """Draws inside come from this rank's own stream; the default generator advances by one
    draw, the same on every rank. ``draws=False``: nothing to do (the call draws nothing)."""
    if not draws:
        yield
        return
    seed = int(torch.randint(0, 2**62, (), device="cpu"))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((seed ^ (rank * _MIX)) % 2**63)
        yield


def check_in_step(prints: list[int], rank: int, where: str) -> None:
    """Raise on every rank of a domain group when its generators' ``prints`` (one per domain
    rank, the same list everywhere) differ."""
    if len(set(prints)) <= 1:
        return
    groups: dict[int, list[int]] = {}
    for r, p in enumerate(prints):
        groups.setdefault(p, []).append(r)
    raise ConfigError(
        f"rank {rank}: {where}: the domain ranks' random generators are not in step (domain "
        f"ranks {' vs '.join(str(g) for g in groups.values())} hold different states), so a "
        f"random draw on a value they all hold (dropout, noise) differs between them and the "
        f"model is not the serial one; seed every rank of a domain group the same "
        f"(torch.manual_seed(seed + dp_rank)) before building and running the model"
    )
