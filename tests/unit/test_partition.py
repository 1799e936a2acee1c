from __future__ import annotations

import pytest

from mpidp.errors import ConfigError
from mpidp.partition import balanced_sizes, offsets


@pytest.mark.parametrize(
    "n, parts, want",
    [
        (721, 4, (181, 180, 180, 180)),
        (13, 3, (5, 4, 4)),
        (4, 4, (1, 1, 1, 1)),
        (721, 1, (721,)),
    ],
)
def test_balanced(n, parts, want):
    assert balanced_sizes(n, parts) == want
    assert sum(want) == n


def test_more_ranks_than_rows():
    with pytest.raises(ConfigError, match="cannot split 3 rows over 4 ranks; use at most 3 ranks"):
        balanced_sizes(3, 4)
    assert balanced_sizes(3, 4, allow_empty=True) == (1, 1, 1, 0)


def test_offsets():
    assert offsets((181, 180, 180, 180)) == (0, 181, 361, 541)
