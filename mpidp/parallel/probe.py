"""Is a module mpidp does not know exact on a latitude band? Run it and see.

A module is exact on a band when, for every band of rows along the sharded dim, running it on
the band gives the band of its output on the whole field: ``f(x[a:b]) == f(x)[a:b]``. That
holds for pointwise and channel-wise modules and fails for anything that reads other rows
(a convolution, a roll, a mean over H, an FFT), depends on the row's position (a position
embedding indexed by row) or on the field's height (a reshape to the global grid).

:func:`probe_band_locality` checks exactly that on a small float64 input (a copy of the module,
in eval mode and, when it is deterministic there, in training mode too): several bands, a
one-row band among them, and for a module that fails, a perturbation of single rows that
names which input rows an output row reads. Local: no communication.

The sharded dim of the probe input is H: dim -2 of channels-first activations (B, C, H, W) and
(B, C, T, H, W), dim -3 of channels-last ones (B, H, W, C) when the module's own sizes say its
input is channels-last (its last dim is its feature size). With ``shape`` (an input shape seen
in a real forward, e.g. from ``example_inputs``), the probe uses that shape with a short H.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["ProbeResult", "probe_band_locality"]

_ROWS = 7  # rows of the probe input along the sharded dim
_BANDS = ((0, 3), (3, 4), (4, 7), (2, 6), (0, 7))
_FEATURE_ATTRS = ("in_features", "embed_dim", "d_model", "hidden_size", "dim", "features")
_CHANNEL_ATTRS = ("in_channels", "num_features", "num_channels", "channels", "in_chans")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """``local``: True (exact on any band), False (mixes rows or depends on them), None (the
    module could not be run on any probe input). ``detail`` says what was seen."""

    local: bool | None
    detail: str


def _feature_size(module: nn.Module) -> int | None:
    for name in _FEATURE_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, Sequence) and len(shape) == 1:
        return int(shape[0])
    return None


def _channel_size(module: nn.Module) -> int | None:
    for name in _CHANNEL_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _guesses(module: nn.Module, shard_dim: int) -> list[tuple[tuple[int, ...], int]]:
    """(input shape, sharded dim) candidates when no real input shape is known."""
    out: list[tuple[tuple[int, ...], int]] = []
    feature = _feature_size(module)
    if feature is not None:  # channels-last tokens: H is dim -3 of (B, H, W, C)
        out.append(((2, _ROWS, 5, feature), -3))
    channels = _channel_size(module)
    firsts = [channels] if channels is not None else []
    firsts += [c for c in (feature, 3, 4, 1, 2, 8, 16, 32, 64) if c is not None and c not in firsts]
    out += [((2, c, _ROWS, 5), shard_dim) for c in firsts]
    out += [((2, 3, 2, _ROWS, 5), shard_dim)]  # (B, C, T, H, W)
    return out


def _from_shape(
    module: nn.Module, shape: Sequence[int], shard_dim: int
) -> list[tuple[tuple[int, ...], int]]:
    """The seen input shape with a short H (its H: channels-last when its last dim is the
    module's feature size and its dim 1 is not its channel count)."""
    dims = list(shape)
    if len(dims) < 2:
        return []
    feature, channels = _feature_size(module), _channel_size(module)
    d = shard_dim
    if len(dims) == 4 and feature is not None and dims[-1] == feature and dims[1] != channels:
        d = -3
    if not -len(dims) <= d < 0:
        return []
    dims[d] = _ROWS
    dims[0] = min(dims[0], 2)
    return [(tuple(dims), d)]


def _float64_copy(module: nn.Module) -> nn.Module:
    """A deep copy with real floats in float64 and complex in complex128 (``.double()`` would
    leave complex64 as it is, ``.to(float64)`` would drop imaginary parts)."""
    twin = copy.deepcopy(module)
    for t in [*twin.parameters(), *twin.buffers()]:
        if t.is_complex():
            t.data = t.data.to(torch.complex128)
        elif t.is_floating_point():
            t.data = t.data.to(torch.float64)
    return twin


def _run(module: nn.Module, x: torch.Tensor, seed: int = 0) -> torch.Tensor | None:
    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone, which fork_rng restores (torch.manual_seed would also seed
        # the accelerators' generators, not restored, and record a stack for each: 2 ms a call)
        torch.default_generator.manual_seed(seed)
        with torch.no_grad():
            y = module(x)
    if isinstance(y, tuple | list) and y and isinstance(y[0], torch.Tensor):
        y = y[0]
    return y if isinstance(y, torch.Tensor) else None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-10, atol=1e-12 * max(scale, 1.0), equal_nan=True))


def _mixing(module: nn.Module, x: torch.Tensor, y: torch.Tensor, d: int) -> str:
    """Which output rows change when one input row is perturbed (the first offender)."""
    for i in range(x.size(d)):
        bumped = x.clone()
        bumped.narrow(d, i, 1).add_(1.0)
        y2 = _run(module, bumped)
        if y2 is None or y2.shape != y.shape:
            return f"perturbing input row {i} changed the output shape"
        moved = [j for j in range(y.size(d)) if not _same(y2.narrow(d, j, 1), y.narrow(d, j, 1))]
        others = [j for j in moved if j != i]
        if others:
            return f"output rows {others} change when input row {i} changes"
    return (
        "each output row reads its own input row alone, but on a band it differs (the row's "
        "position or the field's height enters)"
    )


def _check(module: nn.Module, shape: tuple[int, ...], d: int) -> ProbeResult:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = _run(module, x)
    if y is None:
        return ProbeResult(None, f"on {shape} it returned no tensor")
    where = f"probed on {tuple(shape)} along dim {d}"
    if y.dim() != x.dim() or y.size(d) != x.size(d):
        return ProbeResult(
            False, f"{where}: output {tuple(y.shape)} does not keep the {x.size(d)} rows"
        )
    for a, b in _BANDS:
        part = _run(module, x.narrow(d, a, b - a))
        if part is None or not _same(part, y.narrow(d, a, b - a)):
            return ProbeResult(False, f"{where}: rows {a}:{b} differ; {_mixing(module, x, y, d)}")
    return ProbeResult(True, f"{where}: every band equals its rows of the whole")


def probe_band_locality(
    module: nn.Module, shard_dim: int = -2, shape: Sequence[int] | None = None
) -> ProbeResult:
    """Whether ``module`` computes on any band of rows the band of its output on the whole
    field (see the module docstring). ``shape``: an input shape seen in a real forward; else
    shapes are guessed from the module's sizes. Local: no communication."""
    candidates = _from_shape(module, shape, shard_dim) if shape is not None else []
    candidates += _guesses(module, shard_dim)
    errors: list[str] = []
    twin = _float64_copy(module).eval()
    for cand_shape, d in candidates:
        try:
            result = _check(twin, cand_shape, d)
        except Exception as err:  # this probe input does not suit the module: the next one
            errors.append(f"{tuple(cand_shape)}: {type(err).__name__}: {err}"[:200])
            continue
        if result.local is None:
            errors.append(result.detail)
            continue
        if result.local:
            return _in_training_mode(twin, cand_shape, d) or result
        return result
    return ProbeResult(None, f"no probe input suited it ({'; '.join(errors[:3])})")


def _in_training_mode(twin: nn.Module, shape: tuple[int, ...], d: int) -> ProbeResult | None:
    """The band check in training mode too, on the float64 copy the eval-mode checks used (they
    changed nothing in it: no running statistics move in eval mode), when the module is
    deterministic there (with dropout it is not, and eval mode decided); a failure there, else
    None."""
    twin.train()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    try:
        first, second = _run(twin, x, seed=1), _run(twin, x, seed=2)
        if first is None or second is None or not _same(first, second):
            return None
        result = _check(twin, shape, d)
    except Exception:
        return None
    if result.local is False:
        return ProbeResult(False, f"in training mode, {result.detail}")
    return None
