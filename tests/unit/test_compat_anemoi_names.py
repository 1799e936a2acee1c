"""mpidp.compat.anemoi keeps every name of anemoi's documented ``anemoi.models.distributed``
API (docs: /work/shared/apis/anemoi_models_distributed.txt) with its signature: parameter
names, order and defaults, importable from the package and from the submodule it lives in in
anemoi. No MPI: the paths that communicate nothing (``mgroup`` None) run here too."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest
import torch

import mpidp
import mpidp.compat.anemoi as compat

# name: (anemoi's submodule, the signature anemoi documents); annotations are not compared
API = {
    "shard_tensor": (
        "graph",
        "(input_: Tensor, dim: int, shapes: tuple, mgroup: ProcessGroup, "
        "gather_in_backward: bool = True)",
    ),
    "gather_tensor": ("graph", "(input_: Tensor, dim: int, shapes: tuple, mgroup: ProcessGroup)"),
    "reduce_tensor": ("graph", "(input_: Tensor, mgroup: ProcessGroup)"),
    "sync_tensor": ("graph", "(input_: Tensor, dim: int, shapes: tuple, mgroup: ProcessGroup)"),
    "reduce_shard_tensor": (
        "graph",
        "(input_: Tensor, dim: int, shapes: tuple, mgroup: ProcessGroup)",
    ),
    "get_k_hop_edges": (
        "khop_edges",
        "(nodes: Tensor, edge_attr: Tensor, edge_index: Tensor | SparseTensor, num_hops: int = 1)",
    ),
    "sort_edges_1hop_sharding": (
        "khop_edges",
        "(num_nodes: int | tuple[int, int], edge_attr: Tensor, edge_index: Tensor | SparseTensor, "
        "mgroup: ProcessGroup | None = None)",
    ),
    "sort_edges_1hop_chunks": (
        "khop_edges",
        "(num_nodes: int | tuple[int, int], edge_attr: Tensor, edge_index: Tensor | SparseTensor, "
        "num_chunks: int)",
    ),
    "get_shape_shards": (
        "shapes",
        "(tensor: Tensor, dim: int, model_comm_group: ProcessGroup | None = None)",
    ),
    "change_channels_in_shape": ("shapes", "(shape_list: list, channels: int)"),
    "shard_heads": ("transformer", "(input_: Tensor, shapes: list, mgroup: ProcessGroup)"),
    "shard_sequence": ("transformer", "(input_: Tensor, shapes: list, mgroup: ProcessGroup)"),
    "get_memory_format": ("utils", "(tensor: Tensor)"),
    # from anemoi's later releases, not in the documented API
    "all_to_all_transpose": (
        "graph",
        "(input_: Tensor, dim_split: int, split_sizes: ShardSizes, dim_concat: int, "
        "concat_sizes: ShardSizes, mgroup: ProcessGroup)",
    ),
}


def documented(signature: str) -> list[tuple[str, object]]:
    """``(name, default)`` of each parameter of a documented signature, in order (``empty``
    where there is no default)."""
    args = ast.parse(f"def f{signature}: pass").body[0].args  # type: ignore[attr-defined]
    params = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(params) - len(args.defaults))
    defaults += [ast.literal_eval(d) for d in args.defaults]
    return [(p.arg, d) for p, d in zip(params, defaults, strict=True)]


def actual(fn: object) -> list[tuple[str, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    kinds = {p.kind for p in sig.parameters.values()}
    assert kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD}, f"{fn}: {sig}"
    return [(p.name, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", sorted(API))
def test_every_documented_name_keeps_its_signature(name):
    module, signature = API[name]
    here = getattr(importlib.import_module(f"mpidp.compat.anemoi.{module}"), name)
    assert getattr(compat, name) is here
    assert actual(here) == documented(signature), f"{name}{inspect.signature(here)}"
    assert here.__doc__


def test_the_package_exports_exactly_the_table():
    assert sorted(compat.__all__) == sorted(API)
    for module in {m for m, _ in API.values()}:
        mod = importlib.import_module(f"mpidp.compat.anemoi.{module}")
        assert sorted(mod.__all__) == sorted(n for n, (m, _) in API.items() if m == module)


def test_without_a_group_nothing_moves():
    """anemoi's ``mgroup`` None: the identity, forward and backward, and no shapes read."""
    x = torch.arange(6.0, dtype=torch.float64).reshape(3, 2).requires_grad_()
    for y in (
        compat.shard_tensor(x, 0, None, None),  # type: ignore[arg-type]
        compat.shard_tensor(x, 0, (), None, gather_in_backward=False),
        compat.gather_tensor(x, 0, (), None),
        compat.reduce_tensor(x, None),
        compat.sync_tensor(x, 0, (), None),
        compat.reduce_shard_tensor(x, 0, (), None),
        compat.shard_heads(x, [], None),
        compat.shard_sequence(x, [], None),
    ):
        assert y is x
    attr, index = torch.ones(4, 3), torch.tensor([[0, 1, 2, 0], [2, 0, 1, 1]])
    a, i, sa, si = compat.sort_edges_1hop_sharding(3, attr, index)
    assert a is attr and i is index and sa == [] and si == []
    assert compat.get_shape_shards(torch.zeros(5, 7), 0) == [[5, 7]]


def test_shapes_and_memory_format():
    t = torch.zeros(2, 7, 3)
    assert compat.change_channels_in_shape([[7, 3], [4, 3]], 8) == [[7, 8], [4, 8]]
    assert compat.change_channels_in_shape([torch.Size([7, 3])], 8) == [[7, 8]]
    assert compat.change_channels_in_shape([], 8) == []
    assert compat.get_memory_format(t) is torch.contiguous_format
    cl = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert compat.get_memory_format(cl) is torch.channels_last
    with pytest.raises(mpidp.ConfigError, match="dim 3"):
        compat.get_shape_shards(t, 3)


def test_the_pre_move_module_warns_once_naming_its_successor():
    """``import mpidp.anemoi`` (in a fresh process: the warning comes with the first import)
    warns, once, that it moved to mpidp.compat.anemoi."""
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import mpidp.anemoi\n"
        "print([(w.category.__name__, str(w.message), w.filename) for w in seen])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seen = ast.literal_eval(res.stdout.strip().splitlines()[-1])
    mine = [w for w in seen if w[1].startswith("mpidp")]
    assert len(mine) == 1 and mine[0][0] == "DeprecationWarning", seen
    assert "moved to mpidp.compat.anemoi" in mine[0][1]
