"""Every name of PhysicsNeMo's ``physicsnemo.distributed`` API at its compat home, with
PhysicsNeMo's parameter names, order and defaults (annotations aside). No MPI needed."""

from __future__ import annotations

import importlib
import inspect

import pytest

HOME = "mpidp.compat.physicsnemo.distributed"

#: (module under HOME, qualified name) -> PhysicsNeMo's parameters (``self``/``ctx`` left out)
API = {
    ("manager", "DistributedManager.initialize"): "()",
    ("manager", "DistributedManager.setup"): (
        "(rank=0, world_size=1, local_rank=None, addr='localhost', port='12355', "
        "backend='nccl', method='env')"
    ),
    ("manager", "DistributedManager.initialize_env"): "()",
    ("manager", "DistributedManager.initialize_open_mpi"): "(addr, port)",
    ("manager", "DistributedManager.initialize_slurm"): "(port)",
    ("manager", "DistributedManager.get_available_backend"): "()",
    ("manager", "DistributedManager.is_initialized"): "()",
    ("manager", "DistributedManager.cleanup"): "(barrier=False)",
    ("manager", "DistributedManager.create_process_subgroup"): (
        "(name, size, group_name=None, verbose=False)"
    ),
    ("manager", "DistributedManager.create_orthogonal_process_group"): (
        "(orthogonal_group_name, group_name, verbose=False)"
    ),
    ("manager", "DistributedManager.group"): "(self, name=None)",
    ("manager", "DistributedManager.group_size"): "(self, name=None)",
    ("manager", "DistributedManager.group_rank"): "(self, name=None)",
    ("manager", "DistributedManager.group_name"): "(self, group=None)",
    ("manager", "DistributedManager.mesh"): "(self, name=None)",
    ("manager", "DistributedManager.mesh_names"): "(self)",
    ("manager", "DistributedManager.mesh_sizes"): "(self)",
    ("manager", "DistributedManager.initialize_mesh"): "(self, mesh_shape, mesh_dim_names)",
    ("manager", "DistributedManager.get_mesh_group"): "(self, mesh)",
    ("utils", "all_gather_v_wrapper"): "(tensor, sizes=None, dim=0, group=None)",
    ("utils", "all_gather_v_bwd_wrapper"): "(tensor, sizes, dim=0, use_fp32=True, group=None)",
    ("utils", "gather_v_wrapper"): "(tensor, sizes, dim=0, dst=0, group=None)",
    ("utils", "scatter_v_wrapper"): "(tensor, sizes, dim=0, src=0, group=None)",
    ("utils", "indexed_all_to_all_v_wrapper"): "(tensor, indices, sizes, dim=0, group=None)",
    ("utils", "indexed_all_to_all_v_wrapper_bwd"): (
        "(tensor, indices, sizes, tensor_size_along_dim, use_fp32=True, dim=0, group=None)"
    ),
    ("utils", "distributed_transpose"): "(tensor, dim0, dim1, group=None, async_op=False)",
    ("utils", "pad_helper"): "(tensor, dim, new_size, mode='zero')",
    ("utils", "truncate_helper"): "(tensor, dim, new_size)",
    ("utils", "compute_split_shapes"): "(size, num_chunks)",
    ("utils", "reduce_loss"): "(loss, dst_rank=0, mean=True)",
    ("utils", "mark_module_as_shared"): (
        "(module, process_group, recurse=True, use_fp32_reduction=True)"
    ),
    ("utils", "unmark_module_as_shared"): "(module, recurse=True)",
    ("autograd", "all_gather_v"): "(tensor, sizes, dim=0, use_fp32=True, group=None)",
    ("autograd", "gather_v"): "(tensor, sizes, dim=0, dst=0, group=None)",
    ("autograd", "scatter_v"): "(tensor, sizes, dim=0, src=0, group=None)",
    ("autograd", "indexed_all_to_all_v"): (
        "(tensor, indices, sizes, use_fp32=True, dim=0, group=None)"
    ),
    ("autograd", "AllGatherVAutograd.apply"): "(tensor, sizes, dim=0, use_fp32=True, group=None)",
    ("autograd", "GatherVAutograd.apply"): "(tensor, sizes, dim=0, dst=0, group=None)",
    ("autograd", "ScatterVAutograd.apply"): "(tensor, sizes, dim=0, src=0, group=None)",
    ("autograd", "IndexedAllToAllVAutograd.apply"): (
        "(tensor, indices, sizes, use_fp32=True, dim=0, group=None)"
    ),
    ("fft", "DistributedRFFT2.apply"): "(x, s, dim, norm='ortho')",
    ("fft", "DistributedIRFFT2.apply"): "(x, s, dim, norm='ortho')",
    ("mappings", "copy_to_parallel_region"): "(input, group)",
    ("mappings", "reduce_from_parallel_region"): "(input, group)",
    ("mappings", "scatter_to_parallel_region"): "(input, dim, group)",
    ("mappings", "gather_from_parallel_region"): "(input, dim, shapes, group)",
}

PROPERTIES = [
    "rank",
    "local_rank",
    "world_size",
    "device",
    "distributed",
    "cuda",
    "mesh_dims",
    "group_names",
    "global_mesh",
    "broadcast_buffers",
    "find_unused_parameters",
]

#: what ``physicsnemo.distributed`` itself re-exports (config and fused_all_reduce left out)
PACKAGE = [
    "DistributedManager",
    "PhysicsNeMoUndefinedGroupError",
    "PhysicsNeMoUninitializedDistributedManagerWarning",
    "all_gather_v",
    "gather_v",
    "indexed_all_to_all_v",
    "mark_module_as_shared",
    "reduce_loss",
    "scatter_v",
    "unmark_module_as_shared",
]


def _plain(sig: inspect.Signature) -> str:
    """``(a, b=0)``: names, order and defaults, without annotations."""
    parts = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in sig.parameters.values()
    ]
    return f"({', '.join(parts)})"


def _lookup(module: str, qualname: str) -> object:
    obj: object = importlib.import_module(f"{HOME}.{module}")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("where", "want"), list(API.items()), ids=[n for _, n in API])
def test_signature(where: tuple[str, str], want: str) -> None:
    assert _plain(inspect.signature(_lookup(*where))) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("name", PROPERTIES)
def test_property(name: str) -> None:
    manager = importlib.import_module(f"{HOME}.manager").DistributedManager
    assert isinstance(inspect.getattr_static(manager, name), property)


@pytest.mark.parametrize("name", PACKAGE)
def test_package_reexports(name: str) -> None:
    package = importlib.import_module(HOME)
    assert name in package.__all__ and getattr(package, name) is not None


def test_uninitialised_manager_raises_physicsnemo_error() -> None:
    from mpidp.compat.physicsnemo.distributed import (
        DistributedManager,
        PhysicsNeMoUninitializedDistributedManagerWarning,
    )
    from mpidp.errors import ConfigError

    if DistributedManager.is_initialized():
        pytest.skip("initialised by an earlier test in this process")
    with pytest.raises(PhysicsNeMoUninitializedDistributedManagerWarning, match="initialize"):
        DistributedManager()
    assert issubclass(PhysicsNeMoUninitializedDistributedManagerWarning, ConfigError)


def test_compute_split_shapes_is_physicsnemos_cut() -> None:
    from mpidp.compat.physicsnemo.distributed.utils import compute_split_shapes

    assert compute_split_shapes(10, 4) == [3, 3, 3, 1]
    assert compute_split_shapes(9, 4) == [2, 2, 2, 3]  # ceil would leave the last empty
    assert compute_split_shapes(7, 1) == [7]


def test_pad_helper_zero_and_conj() -> None:
    import torch

    from mpidp.compat.physicsnemo.distributed.utils import pad_helper, truncate_helper

    x = torch.tensor([[1 + 1j, 2 + 2j, 3 - 1j]])
    assert pad_helper(x, 1, 5).tolist() == [[1 + 1j, 2 + 2j, 3 - 1j, 0, 0]]
    assert pad_helper(x, -1, 5, mode="conj").tolist() == [[1 + 1j, 2 + 2j, 3 - 1j, 3 + 1j, 2 - 2j]]
    assert truncate_helper(x, 1, 2).tolist() == [[1 + 1j, 2 + 2j]]
