"""Domain parallelism composed with DDP, FSDP2 and tensor parallelism on one DeviceMesh.

The world is a 3-D mesh ``(dp, tp, domain)``, domain innermost: a domain group is a run of
consecutive ranks, exactly the manager's, so the domain-parallel layers and the mesh agree.

Order (each step optional; see docs/launching.md):

1. ``meshes = build_device_mesh({"data": "fsdp2", "tensor": 2, "domain": 2})``
2. ``broadcast_parameters(model, meshes.manager)``: every rank starts from the same weights
3. ``apply_tensor_parallel(model, meshes["tp"])``: the opted-in 1x1 convs and linears keep
   their slice of the channels
4. ``model = apply_domain_parallel(model, meshes["domain"])``: halos and band statistics
5. ``apply_fsdp2(model, meshes["dp"])`` or ``model = apply_ddp(model, meshes["dp"])``
6. per step: forward on this replica's samples and this rank's band, loss with
   :func:`mpidp.global_mean` over the domain group, ``backward()`` (DDP/FSDP2 average over dp),
   then ``sync_domain_gradients(model, meshes.manager)`` (sum over the domain), then step.

Gradient algebra: a domain rank holds part of every parameter's gradient (its band's), so the
domain ranks' gradients are summed; data-parallel replicas saw different samples, so theirs
are averaged. Tensor-parallel shards are never summed with each other: the ranks of one
domain group share a tp coordinate, so the domain sum adds the same shard's partial gradients.
"""

from mpidp.parallel.compose import apply_ddp, apply_domain_parallel, apply_fsdp2
from mpidp.parallel.config import DATA_MODES, MESH_DIMS, MixedPrecision, ParallelismConfig
from mpidp.parallel.mesh import ParallelMesh, build_device_mesh, sync_domain_gradients
from mpidp.parallel.state import (
    full_optimizer_state,
    full_state_dict,
    load_full_state_dict,
    tensor_parallel_size,
)
from mpidp.parallel.tensor_parallel import (
    TensorParallelConv2d,
    TensorParallelLinear,
    apply_tensor_parallel,
)

__all__ = [
    "DATA_MODES",
    "MESH_DIMS",
    "MixedPrecision",
    "ParallelMesh",
    "ParallelismConfig",
    "TensorParallelConv2d",
    "TensorParallelLinear",
    "apply_ddp",
    "apply_domain_parallel",
    "apply_fsdp2",
    "apply_tensor_parallel",
    "build_device_mesh",
    "full_optimizer_state",
    "full_state_dict",
    "load_full_state_dict",
    "sync_domain_gradients",
    "tensor_parallel_size",
]
