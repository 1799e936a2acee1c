"""Checkpoints of a domain-parallel run that load at any domain and data-parallel size.

Domain parallelism keeps every parameter whole and the serial model's ``state_dict`` keys
(DESIGN decision 6), and gradients are synchronised, so model and optimizer state are
replicated on every rank: one rank (world rank 0) writes them, with the layout that produced
them recorded beside. FSDP2 and tensor-parallel shards (:mod:`mpidp.parallel`) are gathered
into the serial tensors first, on every rank, and cut again on load. Loading reads the file on
every rank; the serial model loads it too (``torch.load(path)["model"]``).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpidp.comm import Transport
from mpidp.errors import DataError
from mpidp.io._common import (
    check_everywhere,
    commit,
    describe_error,
    io_transport,
    shared_token,
    temporary_name,
)
from mpidp.parallel.state import (
    _unwrap,
    full_optimizer_state,
    full_state_dict,
    load_full_state_dict,
    tensor_parallel_size,
)
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "mpidp-checkpoint-1"


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state (dicts, lists), with a readable path, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, Mapping):
        out = []
        for k in sorted(obj, key=str):
            out += _tensors(obj[k], f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(obj, (list, tuple)):
        out = []
        for i, v in enumerate(obj):
            out += _tensors(v, f"{prefix}[{i}]")
        return out
    return []


def _checksums(state: Mapping[str, Any]) -> list[tuple[str, int]]:
    out = []
    for name, t in _tensors(state):
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out.append((name, zlib.crc32(data.tobytes())))
    return out


def _layout(manager: DistributedManager | None, model: nn.Module) -> dict[str, int]:
    tensor = tensor_parallel_size(model)
    if manager is None:
        return {"world": 1, "dp": 1, "tensor": tensor, "domain": 1}
    return {
        "world": manager.world_size,
        "dp": manager.dp_world_size // tensor,
        "tensor": tensor,
        "domain": manager.domain_world_size,
    }


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    manager: DistributedManager | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    verify: bool = True,
) -> Path:
    """Save model, optimizer and step to ``path`` (atomically); returns the path.

    The file holds ``{"model", "optimizer", "step", "extra", "layout", "format"}``: the
    serial model's state_dict keys, whatever wrapper ``model`` is in. World rank 0 writes;
    ``verify`` first checks that the parameters and optimizer state really are the same on
    every rank (one all-gather of a checksum; the differing names are reported if not), since
    a checkpoint of one rank's diverged copy would silently drop the others'. Collective over
    the world.
    """
    if manager is None and is_initialized():
        manager = get_manager()
    t = io_transport(manager, "world")
    path = Path(path)
    # Sharded state (FSDP2 over dp, tensor-parallel layers over tp) is gathered into the
    # serial model's tensors, on every rank (collective).
    model_state = full_state_dict(model)
    state = {
        "format": FORMAT,
        "model": model_state,
        "optimizer": None if optimizer is None else full_optimizer_state(optimizer, model),
        "step": int(step),
        "extra": dict(extra or {}),
        "layout": _layout(manager, model),
    }
    problems = [] if path.parent.is_dir() else [f"the folder {path.parent} does not exist"]
    facts = {"path": os.path.realpath(path), "step": int(step), "verify": bool(verify)}
    if t is not None:
        problems += _verify(t, model, model_state, state["optimizer"], facts)
    check_everywhere(
        t,
        problems,
        facts,
        f"save_checkpoint({str(path)!r}) cannot save",
        "call it on every rank with the same path, step and verify, after the gradients "
        "were synchronised (or pass verify=False on every rank to save rank 0's copy)",
    )
    tmp = temporary_name(path, shared_token(t))
    error = None
    if t is None or t.rank == 0:
        try:
            torch.save(state, tmp)
        except Exception as err:
            error = err
    commit(t, tmp, path, error, f"save_checkpoint({str(path)!r})")
    return path


def _verify(
    t: Transport,
    model: nn.Module,
    model_state: Mapping[str, Any],
    optimizer_state: Any,
    facts: Mapping[str, Any],
) -> list[str]:
    """With ``verify``: what differs between the ranks' parameters and optimizer state. The
    ranks first agree on the arguments (a fingerprint of ``facts`` travels with the checksum,
    in one all-gather), so a ``verify`` passed on some ranks only is reported, not a hang or
    MPI's "Message truncated". Collective."""
    key = zlib.crc32(repr(sorted(facts.items())).encode())
    sums: list[tuple[str, int]] = []
    if facts["verify"]:
        names = [n for n, _ in _unwrap(model).named_parameters()]
        params = {
            "model": {n: model_state[n] for n in names if n in model_state},
            "optimizer": optimizer_state,
        }
        sums = _checksums(params)
    table = t.all_gather_ints([key, zlib.crc32(repr(sums).encode())])
    if any(row[0] != table[0][0] for row in table) or not facts["verify"]:
        return []  # arguments that differ are reported by the caller's check_everywhere
    if all(row[1] == table[0][1] for row in table):
        return []
    everyone = t.all_gather_object(sums)
    differ = sorted(
        {
            n
            for theirs in everyone
            for (n, c), (_, c0) in zip(theirs, everyone[0], strict=False)
            if c != c0
        }
    )
    return [
        f"parameters or optimizer state differ between ranks: {differ[:8]}"
        + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
        + " (gradients not synchronised? use mpidp.sync_gradients or DDP, and "
        "mpidp.broadcast_parameters at the start)"
    ]


def _damaged_metadata(path: str | os.PathLike[str], state: dict[str, Any]) -> list[str]:
    """What is wrong with the entries beside ``model`` (absent ones are fine: a plain
    ``{"model": state_dict}`` file loads too)."""
    wrong = []
    fmt = state.get("format", FORMAT)
    if fmt != FORMAT:
        wrong.append(f"format={fmt!r}, this mpidp reads {FORMAT!r} (written by a newer one?)")
    expect: dict[str, Any] = {
        "model": dict,
        "step": int,
        "extra": dict,
        "layout": dict,
        "optimizer": (dict, type(None)),
    }
    for key, kind in expect.items():
        if key in state and not isinstance(state[key], kind):
            wrong.append(f"{key} is a {type(state[key]).__name__}")
    layout = state.get("layout")
    if isinstance(layout, dict) and not all(isinstance(v, int) and v >= 1 for v in layout.values()):
        wrong.append(f"layout={layout!r} (sizes must be positive ints)")
    if not wrong:
        return []
    return [f"{path}: its metadata is damaged or from another program: " + "; ".join(wrong)]


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    manager: DistributedManager | None = None,
    *,
    map_location: str | torch.device | None = None,
    strict: bool = True,
    verify: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` at any domain/data-parallel size
    (or a plain ``{"model": state_dict}`` file) into ``model`` and ``optimizer``; returns the
    whole dictionary (``step``, ``extra``, ``layout`` of the run that saved it). Every rank
    reads the file; a missing or unreadable file raises the same
    :class:`~mpidp.DataError` on every rank. ``verify``: the ranks also compare a checksum of
    what they read (ranks that read different copies of the file raise). ``strict`` and
    ``verify`` must be the same on every rank (checked). Collective over the world."""
    if manager is None and is_initialized():
        manager = get_manager()
    t = io_transport(manager, "world")
    if map_location is None:
        map_location = "cpu" if manager is None else manager.device
    problems: list[str] = []
    state: dict[str, Any] = {}
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
        if not isinstance(state, dict) or "model" not in state:
            problems.append(f"{path} is not an mpidp checkpoint (no 'model' entry)")
        else:
            problems += _damaged_metadata(path, state)
    except FileNotFoundError:
        problems.append(f"{path}: no such file")
    except Exception as err:
        problems.append(f"{path}: unreadable ({describe_error(err)})")
    if not problems and model is not None:
        try:
            load_full_state_dict(
                model, state["model"], optimizer, state.get("optimizer"), strict=strict
            )
        except Exception as err:
            problems.append(f"{path} does not fit the model ({describe_error(err)})")
    crc = zlib.crc32(repr(_checksums(state)).encode()) if verify and not problems else 0
    table = check_everywhere(
        t,
        problems,
        {"path": os.path.realpath(path), "strict": bool(strict), "verify": bool(verify)},
        f"load_checkpoint({str(path)!r}) failed",
        "check the path (visible from every rank), that the model is the one that was saved, "
        "and pass the same strict and verify on every rank",
        [crc],
    )
    if verify and any(row[0] != table[0][0] for row in table):
        rank = 0 if t is None else t.rank
        differ = [r for r, row in enumerate(table) if row[0] != table[0][0]]
        raise DataError(
            f"rank {rank}: load_checkpoint({str(path)!r}, verify=True): ranks {differ} read "
            f"other contents than rank 0 (checksums {[row[0] for row in table]}); give every "
            "rank the same file (a shared file system, or identical copies)"
        )
    return state
