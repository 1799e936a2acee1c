"""Tensor parallelism for the 1x1 convolutions and linears a model opts in: each rank keeps its
slice of the channels (:func:`apply_tensor_parallel`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.collectives import copy_to, reduce_from
from mpidp.parallel.mesh import _one_dim, _transport
from mpidp.runtime.partition import Balanced, PartitionPolicy, ShardSpec

# -- tensor parallelism -------------------------------------------------------------------------


class _TensorParallel:
    """Shared by the tensor-parallel layers: ``style`` is ``"col"`` (output channels split,
    input replicated: Megatron's column-parallel) or ``"row"`` (input channels split, partial
    outputs summed over the tp group, bias added once: row-parallel). ``spec`` is the split of
    the channels over the tp ranks; ``shards`` maps a parameter name to the dim it is split on."""

    style: str
    spec: ShardSpec
    tp_rank: int
    shards: dict[str, int]
    _tp_mesh: DeviceMesh
    _mpidp_safe = True  # channel-wise: exact on a latitude band, left alone by the conversion

    def _setup(
        self, source: nn.Module, style: str, mesh: DeviceMesh, spec: ShardSpec, rank: int
    ) -> None:
        assert isinstance(self, nn.Module)
        self.style, self.spec, self.tp_rank, self._tp_mesh = style, spec, rank, mesh
        rows = spec.slice(rank)
        self.shards = {"weight": 0, "bias": 0} if style == "col" else {"weight": 1}
        with torch.no_grad():
            for name, param in source.named_parameters(recurse=False):
                dim = self.shards.get(name)
                value = (
                    param.detach()
                    if dim is None
                    else param.detach().narrow(dim, rows.start, rows.stop - rows.start)
                )
                setattr(self, name, nn.Parameter(value.clone(), param.requires_grad))
        if getattr(source, "bias", None) is None:
            self.register_parameter("bias", None)
        self.shards = {n: d for n, d in self.shards.items() if getattr(self, n) is not None}

    def transport(self, device: torch.device) -> Transport:
        return _transport(self._tp_mesh, device)

    def _tp_forward(self, x: torch.Tensor, local: Any) -> torch.Tensor:
        assert isinstance(self, nn.Module)
        t = self.transport(x.device)
        if self.style == "col":
            return local(copy_to(x, t), self.weight, self.bias)
        y = reduce_from(local(x, self.weight, None), t)
        bias = self.bias
        return y if not isinstance(bias, torch.Tensor) else y + self._bias_view(bias)

    def _bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def extra_repr(self) -> str:
        assert isinstance(self, nn.Module)
        base = super().extra_repr()  # type: ignore[misc]  # the torch layer's own description
        return f"{base}, tp={self.style} {list(self.spec.sizes)} rank {self.tp_rank}"


class TensorParallelLinear(_TensorParallel, nn.Linear):
    """An ``nn.Linear`` whose output (``col``) or input (``row``) features are split over the tp
    group; built by :func:`apply_tensor_parallel`. Parameter names are the serial layer's."""

    def __init__(
        self, source: nn.Linear, style: str, mesh: DeviceMesh, spec: ShardSpec, rank: int
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = source.in_features, source.out_features
        self._setup(source, style, mesh, spec, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tp_forward(x, F.linear)


class TensorParallelConv2d(_TensorParallel, nn.Conv2d):
    """A 1x1 ``nn.Conv2d`` with its output (``col``) or input (``row``) channels split over the
    tp group; built by :func:`apply_tensor_parallel`. Parameter names are the serial layer's."""

    def __init__(
        self, source: nn.Conv2d, style: str, mesh: DeviceMesh, spec: ShardSpec, rank: int
    ) -> None:
        nn.Module.__init__(self)
        for name in (
            "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
            "transposed", "output_padding", "groups", "padding_mode",
            "_reversed_padding_repeated_twice",
        ):  # fmt: skip
            setattr(self, name, getattr(source, name))
        self._setup(source, style, mesh, spec, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tp_forward(x, self._conv_forward)

    def _bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        return bias.view(-1, 1, 1)


def _tp_problem(layer: nn.Module, style: str, parts: int) -> str | None:
    if isinstance(layer, nn.Linear):
        size = layer.out_features if style == "col" else layer.in_features
    elif isinstance(layer, nn.Conv2d) and not isinstance(layer, nn.ConvTranspose2d):
        if tuple(layer.kernel_size) != (1, 1) or layer.groups != 1:
            return (
                f"a tensor-parallel Conv2d must be 1x1 with groups=1 (kernel "
                f"{tuple(layer.kernel_size)}, groups {layer.groups})"
            )
        size = layer.out_channels if style == "col" else layer.in_channels
    else:
        return f"{type(layer).__name__} is not nn.Linear or a 1x1 nn.Conv2d"
    if size < parts:
        what = "output" if style == "col" else "input"
        return f"{size} {what} channels cannot be split over {parts} tensor-parallel ranks"
    return None


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh | None, *, partition: PartitionPolicy | None = None
) -> nn.Module:
    """Split the layers that opt in over ``tp_mesh``, in place; returns ``model``.

    A module opts in by declaring ``_tp_col`` and ``_tp_row``: dotted paths, relative to that
    module, to its column-parallel layers (output channels split; pair each with a row layer)
    and row-parallel layers (input channels split; outputs summed over tp). ``nn.Linear`` and
    1x1 ``nn.Conv2d`` are supported; only channel-wise operations (activations, dropout)
    belong between a column layer and its row layer. Channels are split by ``partition``
    (default balanced: 6 over 4 ranks is 2, 2, 1, 1), so uneven channel counts work.

    The weights must already be the same on every tp rank (seed, or
    :func:`mpidp.broadcast_parameters` first): each rank keeps its slice. ``tp_mesh`` None or
    of size 1 leaves the model as it is. Raises ConfigError listing every layer that cannot be
    split, before anything changes. No communication.
    """
    if tp_mesh is None:
        return model
    mesh = _one_dim(tp_mesh, "tp_mesh")
    parts = mesh.size()
    rank = mesh.get_local_rank()
    policy = partition if partition is not None else Balanced()
    plan: list[tuple[str, nn.Module, str]] = []
    problems: list[str] = []
    for owner_path, owner in model.named_modules():
        cols, rows = _paths(owner, "_tp_col"), _paths(owner, "_tp_row")
        for style, paths in (("col", cols), ("row", rows)):
            for rel in paths:
                where = f"{owner_path}.{rel}" if owner_path else rel
                if rel in cols and rel in rows:
                    problems.append(f"{where}: listed in both _tp_col and _tp_row")
                    continue
                try:
                    layer = owner.get_submodule(rel)
                except AttributeError:
                    problems.append(
                        f"{where}: no such module (declared in {owner_path or 'the model'})"
                    )
                    continue
                if isinstance(layer, _TensorParallel):
                    continue  # applied already
                problem = _tp_problem(layer, style, parts)
                if problem:
                    problems.append(f"{where}: {problem}")
                else:
                    plan.append((where, layer, style))
    if problems:
        raise ConfigError(
            "apply_tensor_parallel: cannot split\n  " + "\n  ".join(sorted(set(problems)))
        )
    if parts == 1:
        return model
    for where, layer, style in plan:
        size = _split_size(layer, style)
        spec = policy.spec(size, parts)
        kind = TensorParallelLinear if isinstance(layer, nn.Linear) else TensorParallelConv2d
        replacement = kind(layer, style, mesh, spec, rank)  # type: ignore[arg-type]
        parent_path, _, name = where.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, replacement)
    return model


def _paths(owner: nn.Module, attribute: str) -> list[str]:
    value = getattr(owner, attribute, None) or ()
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _split_size(layer: nn.Module, style: str) -> int:
    if isinstance(layer, nn.Linear):
        return layer.out_features if style == "col" else layer.in_features
    assert isinstance(layer, nn.Conv2d)
    return layer.out_channels if style == "col" else layer.in_channels
