"""PhysicsNeMo's ``physicsnemo.distributed`` on mpidp: change the import, keep the code.

The package re-exports what PhysicsNeMo's does; ``ProcessGroupConfig``/``ProcessGroupNode``
(a treelib-based group tree) and ``fused_all_reduce`` are left out (docs/migration.md).
"""

from mpidp.compat.physicsnemo.distributed.autograd import (
    all_gather_v,
    gather_v,
    indexed_all_to_all_v,
    scatter_v,
)
from mpidp.compat.physicsnemo.distributed.manager import (
    DistributedManager,
    PhysicsNeMoUndefinedGroupError,
    PhysicsNeMoUninitializedDistributedManagerWarning,
)
from mpidp.compat.physicsnemo.distributed.utils import (
    mark_module_as_shared,
    reduce_loss,
    unmark_module_as_shared,
)

__all__ = [
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
