"""Every name of CREDIT's ``credit.domain_parallel`` and ``credit.parallel`` and of
PhysicsNeMo's ``physicsnemo.domain_parallel`` (the published APIs, /work/shared/apis) is
importable from its mpidp.compat home with the documented parameters, order and defaults."""

from __future__ import annotations

import importlib
import inspect

import pytest

#: (module, name, documented parameters; None for a class/property checked by import only)
NAMES = [
    (
        "credit.domain_parallel",
        "DomainParallelManager",
        "world_size, domain_parallel_size, shard_dim=-2",
    ),
    (
        "credit.domain_parallel",
        "initialize_domain_parallel",
        "world_size, domain_parallel_size, shard_dim=-2",
    ),
    ("credit.domain_parallel", "get_domain_parallel_manager", ""),
    ("credit.domain_parallel", "HaloExchange", "halo_width, dim=-2"),
    ("credit.domain_parallel", "DomainParallelConv2d", "conv, shard_dim=-2"),
    ("credit.domain_parallel", "DomainParallelConv3d", "conv, shard_dim=3"),
    ("credit.domain_parallel", "DomainParallelConvTranspose2d", "conv, shard_dim=-2"),
    ("credit.domain_parallel", "DomainParallelConvTranspose3d", "conv, shard_dim=3"),
    ("credit.domain_parallel", "DomainParallelGroupNorm", "norm"),
    ("credit.domain_parallel", "DomainParallelInterpolate", "size, mode='bilinear', shard_dim=-2"),
    ("credit.domain_parallel", "DomainParallelPeriodicConv2d", "periodic_conv, shard_dim=-2"),
    (
        "credit.domain_parallel",
        "convert_to_domain_parallel",
        "model, manager, shard_dim=-2, custom_converters=None",
    ),
    (
        "credit.domain_parallel",
        "validate_sharding_constraints",
        "model, local_h, window_sizes=None",
    ),
    ("credit.domain_parallel", "shard_tensor", "x, dim=-2, manager=None"),
    ("credit.domain_parallel", "gather_tensor", "x, dim=-2, manager=None"),
    (
        "credit.domain_parallel",
        "shard_batch",
        "batch, spatial_dims_5d=-2, spatial_dims_4d=-2, manager=None",
    ),
    (
        "credit.domain_parallel.layers",
        "DomainParallelPeriodicConv2d",
        "periodic_conv, shard_dim=-2",
    ),
    (
        "credit.domain_parallel.manager",
        "DomainParallelManager",
        "world_size, domain_parallel_size, shard_dim=-2",
    ),
    ("credit.domain_parallel.sharding", "shard_tensor", "x, dim=-2, manager=None"),
    (
        "credit.domain_parallel.convert",
        "convert_to_domain_parallel",
        "model, manager, shard_dim=-2, custom_converters=None",
    ),
    ("credit.domain_parallel.halo_exchange", "HaloExchange", "halo_width, dim=-2"),
    ("credit.parallel", "build_device_mesh", "parallelism_conf, device='cuda'"),
    ("credit.parallel", "apply_fsdp2", "model, dp_mesh, conf"),
    ("credit.parallel", "apply_tensor_parallel", "model, tp_mesh"),
    ("credit.parallel", "apply_domain_parallel", "model, domain_mesh"),
    ("credit.parallel", "apply_ddp", "model, dp_mesh"),
    ("credit.parallel", "get_domain_manager", "model"),
    ("credit.parallel", "get_raw_model", "model"),
    ("credit.parallel", "shard_spatial", "tensor, manager"),
    ("credit.parallel", "unpad_shard_interp", "y_pred, padding_opt, manager, image_h, image_w"),
    ("credit.parallel", "sync_domain_gradients", "model, manager"),
    (
        "physicsnemo.domain_parallel",
        "scatter_tensor",
        "tensor, global_src, mesh, placements, global_shape=None, dtype=None, requires_grad=False",
    ),
    (
        "physicsnemo.domain_parallel",
        "ShardTensor.from_local",
        # the published four, and the fifth that PhysicsNeMo 2.2 added (positional there too)
        "local_tensor, device_mesh=None, placements=None, sharding_shapes='infer', "
        "global_shape=None",
    ),
    ("physicsnemo.domain_parallel", "ShardTensor.from_dtensor", "dtensor"),
    ("physicsnemo.domain_parallel", "ShardTensor.full_tensor", "self, *, grad_placements=None"),
    ("physicsnemo.domain_parallel", "ShardTensor.to_local", "self, *, grad_placements=None"),
    ("physicsnemo.domain_parallel", "ShardTensor.offsets", "self, mesh_dim=None"),
    (
        "physicsnemo.domain_parallel",
        "ShardTensor.redistribute",
        "self, device_mesh=None, placements=None, *, async_op=False",
    ),
    ("physicsnemo.domain_parallel", "ShardTensor.patches_enabled", ""),
    ("physicsnemo.domain_parallel", "ShardTensor.register_dispatch_handler", "op, handler"),
    ("physicsnemo.domain_parallel", "ShardTensor.register_function_handler", "func, handler"),
    (
        "physicsnemo.domain_parallel",
        "ShardTensor.register_named_function_handler",
        "func_name, handler",
    ),
]


def _documented(params: inspect.Signature) -> str:
    """The parameters as documented: mpidp's extra keyword-only ones (after them) left out."""
    out, star = [], False
    for p in params.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            star = True
            out.append("*")
        if p.kind is p.KEYWORD_ONLY and p.name not in ("async_op", "grad_placements"):
            continue
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    while out and out[-1] == "*":
        out.pop()
    return ", ".join(out)


@pytest.mark.parametrize(("module", "name", "params"), NAMES, ids=[f"{m}.{n}" for m, n, _ in NAMES])
def test_every_name_is_there_with_its_signature(module, name, params):
    obj = importlib.import_module(f"mpidp.compat.{module}")
    for part in name.split("."):
        obj = getattr(obj, part)
    assert _documented(inspect.signature(obj)) == params


def test_packages_re_export_their_submodules_names():
    credit = importlib.import_module("mpidp.compat.credit")
    for module, name, _ in NAMES:
        if module in ("credit.domain_parallel", "credit.parallel"):
            assert getattr(credit, name) is getattr(
                importlib.import_module(f"mpidp.compat.{module}"), name
            )
