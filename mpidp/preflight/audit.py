"""The dry run on band shapes: every rank's forward, simulated in one process on meta tensors.

:func:`~mpidp.validate_sharding_constraints` first runs the model on the global shape. Here it
runs again once per domain rank, on that rank's band: each layer mpidp converts is replaced by
its band arithmetic (the output rows the layer gives that rank, no communication), and the
model's own ``forward`` code (reshapes, ``torch.cat`` of skips, shape checks, functional calls)
runs as it is. Two things are reported, each with the source line in the model's code:

- the first op that fails on a band (``cat`` of 14 and 15 rows, a ``view`` to the global grid,
  a ``raise`` on ``x.shape``), and a result whose rows are not the band the policy gives;
- ops in the model's own ``forward`` that mix rows of the sharded dim (a functional conv or
  pool, ``F.interpolate``, ``torch.roll``/``flip``/``fft`` over it, a mean or softmax over it,
  a matmul that contracts it): on a band they run without error and compute something else.

Which dims are sharded is read off the two runs: at the k-th call, a dim whose size on the band
differs from its size in the global run holds the sharded rows (merged dims included).
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Finding", "OpRecorder", "where", "where_error"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_MPIDP_DIR = os.path.dirname(__file__)


def _user_frame() -> FrameType | None:
    """The innermost frame outside torch, mpidp and the interpreter's own modules."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        inside = name.startswith((_TORCH_DIR, _MPIDP_DIR)) or name.startswith("<frozen")
        if not inside and "/contextlib.py" not in name:
            return frame
        frame = frame.f_back
    return None


def _called_from_mpidp() -> bool:
    """True when the first frame outside torch is mpidp's own code (its functional forms)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_MPIDP_DIR) and not name.endswith(("audit.py", "validate.py")):
            return True
        if not name.startswith(_TORCH_DIR) and "/contextlib.py" not in name:
            return False
        frame = frame.f_back
    return False


def where(frame: FrameType | None) -> str:
    if frame is None:
        return "(unknown line)"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} `{code}`"


def where_error(err: BaseException) -> str:
    """The innermost traceback entry in the model's code."""
    tb, found = err.__traceback__, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _MPIDP_DIR)) and "/contextlib.py" not in name:
            found = tb
        tb = tb.tb_next
    if found is None:
        return "(inside torch or mpidp)"
    code = linecache.getline(found.tb_frame.f_code.co_filename, found.tb_lineno).strip()
    return f"{found.tb_frame.f_code.co_filename}:{found.tb_lineno} `{code}`"


# ----------------------------------------------------------------------------- op classes


def _norm(dims: Any, ndim: int) -> set[int]:
    if dims is None:
        return set(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    if isinstance(dims, Sequence) and all(isinstance(d, int) for d in dims):
        return {d % ndim for d in dims} if ndim else set()
    return set()


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _spatial(x: torch.Tensor, sharded: set[int], *_: Any) -> set[int]:
    return sharded & set(range(2, x.dim()))


def _conv(x: torch.Tensor, sharded: set[int], args: tuple, kwargs: dict) -> set[int]:
    w = _arg(args, kwargs, 1, "weight")
    stride = _arg(args, kwargs, 3, "stride", 1)
    out = set()
    for d in _spatial(x, sharded):
        k = w.shape[d] if isinstance(w, torch.Tensor) and w.dim() == x.dim() else 2
        s = stride if isinstance(stride, int) else stride[d - 2]
        if k > 1 or s != 1:
            out.add(d)
    return out


def _pad(x: torch.Tensor, sharded: set[int], args: tuple, kwargs: dict) -> set[int]:
    pad = _arg(args, kwargs, 1, "pad", ())
    out = set()
    for d in sharded:
        at = 2 * (x.dim() - 1 - d)
        if at + 1 < len(pad) and (pad[at] or pad[at + 1]):
            out.add(d)
    return out


def _dims(i: int, name: str, default: Any = "all") -> Callable[..., set[int]]:
    """An op over the dims given as argument ``i`` / ``name`` (``"all"``: every dim when
    absent, as a full reduction; ``None``: no dim when absent)."""

    def check(x: torch.Tensor, sharded: set[int], args: tuple, kwargs: dict) -> set[int]:
        dims = _arg(args, kwargs, i, name, None)
        if dims is None and default != "all":
            dims = default
        if isinstance(dims, torch.Tensor):  # torch.max(a, b): elementwise
            return set()
        return sharded & _norm(dims, x.dim())

    return check


def _last(n: int) -> Callable[..., set[int]]:
    def check(x: torch.Tensor, sharded: set[int], *_: Any) -> set[int]:
        return sharded & set(range(max(x.dim() - n, 0), x.dim()))

    return check


def _layer_norm(x: torch.Tensor, sharded: set[int], args: tuple, kwargs: dict) -> set[int]:
    shape = _arg(args, kwargs, 1, "normalized_shape", ())
    return _last(len(shape))(x, sharded)


def _matmul(x: torch.Tensor, sharded: set[int], args: tuple, kwargs: dict) -> set[int]:
    return sharded & {x.dim() - 1} if x.dim() else set()


def _sdpa(x: torch.Tensor, sharded: set[int], *_: Any) -> set[int]:
    return sharded & {x.dim() - 2}


_FFT_DEFAULTS = {"fft": -1, "ifft": -1, "rfft": -1, "irfft": -1, "hfft": -1, "ihfft": -1}


def _fft(name: str) -> Callable[..., set[int]]:
    def check(x: torch.Tensor, sharded: set[int], args: tuple, kwargs: dict) -> set[int]:
        dims = kwargs.get("dim", args[2] if len(args) > 2 else None)
        if dims is None:
            if name in _FFT_DEFAULTS:
                dims = _FFT_DEFAULTS[name]
            elif name.endswith("2"):
                dims = (-2, -1)
            else:
                dims = None  # fftn: every dim
        return sharded & _norm(dims, x.dim())

    return check


def _table() -> dict[Any, tuple[str, Callable[..., set[int]]]]:
    table: dict[Any, tuple[str, Callable[..., set[int]]]] = {}

    def add(funcs: Sequence[Any], check: Callable[..., set[int]]) -> None:
        for f in funcs:
            name = getattr(f, "__name__", str(f))
            if name.startswith("fft_"):
                name = f"torch.fft.{name[4:]}"
            table[f] = (name, check)

    add([F.conv1d, F.conv2d, F.conv3d], _conv)
    add([F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d], _spatial)
    pools = ["max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool", "lp_pool"]
    add(
        [getattr(F, f"{p}{n}d") for p in pools for n in (1, 2, 3) if hasattr(F, f"{p}{n}d")],
        _spatial,
    )
    add([F.interpolate, F.upsample, F.grid_sample, F.unfold, F.fold], _spatial)
    add([F.pixel_shuffle, F.pixel_unshuffle, torch.pixel_shuffle, torch.pixel_unshuffle], _spatial)
    add([F.group_norm, F.batch_norm, F.instance_norm, F.local_response_norm], _spatial)
    add([F.pad], _pad)
    add([F.layer_norm], _layer_norm)
    add([torch.roll, torch.Tensor.roll], _dims(2, "dims"))
    add([torch.flip, torch.Tensor.flip], _dims(1, "dims", None))
    add([torch.rot90, torch.Tensor.rot90], _dims(2, "dims", (0, 1)))
    reductions = [
        "mean", "sum", "nansum", "nanmean", "amax", "amin", "max", "min", "std", "var", "norm",
        "logsumexp", "prod", "median", "argmax", "argmin", "std_mean", "var_mean", "cumsum",
        "cumprod", "count_nonzero", "any", "all",
    ]  # fmt: skip
    for r in reductions:
        add(
            [f for f in (getattr(torch, r, None), getattr(torch.Tensor, r, None)) if f],
            _dims(1, "dim"),
        )
    add([torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, torch.Tensor.softmax,
         torch.Tensor.log_softmax], _dims(1, "dim", None))  # fmt: skip
    add([torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm], _matmul)
    add([F.linear], _matmul)
    add([F.scaled_dot_product_attention], _sdpa)
    for name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fft2", "ifft2", "rfft2",
                 "irfft2", "fftn", "ifftn", "rfftn", "irfftn"):  # fmt: skip
        add([getattr(torch.fft, name)], _fft(name))
    return table


_OPS = _table()


def _shapes(args: tuple, kwargs: dict) -> list[tuple[int, ...]]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(tuple(a.shape))
        elif isinstance(a, list | tuple):
            out.extend(tuple(t.shape) for t in a if isinstance(t, torch.Tensor))
    return out


@dataclasses.dataclass
class Finding:
    """One row-mixing op in the model's own forward code."""

    op: str
    dims: tuple[int, ...]
    shape: tuple[int, ...]
    line: str

    def __str__(self) -> str:
        return (
            f"{self.line}: {self.op} mixes rows of the sharded dim (dim {list(self.dims)} of a "
            f"{self.shape} band) in the model's own forward code; on a band it runs and "
            f"computes something else. Do it in a module mpidp converts (nn.Conv2d, "
            f"nn.Upsample, nn.AdaptiveAvgPool2d, ...), through mpidp's own functions "
            f"(mpidp.ops.fft, mpidp.global_mean), or in a module with a converter of its own"
        )


class OpRecorder(TorchFunctionMode):
    """Records (global run) or checks (band run) the calls made by containers' own code.

    ``depth`` is kept by hooks on every leaf module (their internals are theirs: torch
    modules, converted layers, probed modules), so only the model's own ``forward`` code is
    seen. The band run compares the k-th call's tensor shapes with the global run's."""

    def __init__(self, reference: list[list[tuple[int, ...]]] | None = None) -> None:
        super().__init__()
        self.calls: list[list[tuple[int, ...]]] = []
        self.reference = reference
        self.findings: list[Finding] = []
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth == 0 and func in _OPS and not _called_from_mpidp():
            shapes = _shapes(args, kwargs)
            k = len(self.calls)
            self.calls.append(shapes)
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None:
                x = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if self.reference is not None and x is not None and k < len(self.reference):
                ref = self.reference[k]
                if ref and len(ref[0]) == x.dim():
                    sharded = {d for d in range(x.dim()) if x.shape[d] != ref[0][d]}
                    name, check = _OPS[func]
                    mixed = check(x, sharded, args, kwargs) if sharded else set()
                    if mixed:
                        finding = Finding(
                            name, tuple(sorted(mixed)), tuple(x.shape), where(_user_frame())
                        )
                        if all(f.line != finding.line for f in self.findings):
                            self.findings.append(finding)
        return func(*args, **kwargs)

    @contextmanager
    def watching(self, model: nn.Module, leaves: Callable[[nn.Module], bool]) -> Iterator[None]:
        def enter(*_: Any) -> None:
            self.depth += 1

        def leave(*_: Any) -> None:
            self.depth -= 1

        with ExitStack() as stack:
            for module in model.modules():
                if module is not model and leaves(module):
                    stack.callback(module.register_forward_pre_hook(enter).remove)
                    stack.callback(module.register_forward_hook(leave, always_call=True).remove)
            with self:
                yield
