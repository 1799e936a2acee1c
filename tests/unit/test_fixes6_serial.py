"""The serial half of an issue 46/47 fix: a band's cut given where blocks are expected (a 2-D
FFT, a halo exchange, a cut of blocks) is a ConfigError naming it, never a TypeError."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp.errors import ConfigError
from mpidp.ops.blocks import as_block_spec
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import ShardSpec


@pytest.mark.parametrize("spec", [ShardSpec((4, 3, 3, 3)), [4, 3, 3, 3], [7, 6], "ab"])
def test_one_cut_is_not_blocks(spec):
    with pytest.raises(ConfigError, match=r"rank 2: spec .* is not the blocks of a latitude x"):
        as_block_spec(spec, (-2, -1), rank=2, fix="; or else")


def test_a_pair_of_cuts_is_blocks():
    got = as_block_spec((np.array([7, 6]).tolist(), list(np.array([10, 9]))), (2, 3))
    assert got == BlockSpec(ShardSpec((7, 6)), ShardSpec((10, 9)), (2, 3))
