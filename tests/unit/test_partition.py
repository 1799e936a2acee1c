from __future__ import annotations

import pytest

from mpidp.errors import ConfigError
from mpidp.runtime.partition import Balanced, ShardSpec, Weighted, balanced_sizes, offsets


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


# -- ShardSpec -------------------------------------------------------------------------------------


def test_shardspec_facts():
    s = ShardSpec.balanced(721, 4)
    assert s.sizes == (181, 180, 180, 180) and s.total == 721 and s.parts == 4
    assert s.offsets == (0, 181, 361, 541)
    assert repr(s) == "ShardSpec(total=721, parts=4, sizes=(181, 180, 180, 180))"
    assert s.slice(2) == slice(361, 541) and (s.start(3), s.stop(3)) == (541, 721)
    assert list(s) == [181, 180, 180, 180] and len(s) == 4 and s[0] == 181
    assert [s.owner(r) for r in (0, 180, 181, 360, 361, 720, -1)] == [0, 0, 1, 1, 2, 3, 3]
    with pytest.raises(ConfigError, match="row 721 is outside"):
        s.owner(721)
    with pytest.raises(ConfigError, match="rank 4 is not a shard"):
        s.slice(4)


def test_shardspec_is_frozen_and_hashable():
    s = ShardSpec.from_sizes([5, 4, 4])
    assert s == ShardSpec.balanced(13, 3) and hash(s) == hash(ShardSpec.balanced(13, 3))
    with pytest.raises(AttributeError):
        s.sizes = (1,)  # type: ignore[misc]


def test_overlaps():
    s = ShardSpec.balanced(13, 3)  # [0,5) [5,9) [9,13)
    assert s.overlaps(3, 10) == [(0, 3, 5), (1, 5, 9), (2, 9, 10)]
    assert s.overlaps(-2, 1) == [(0, 0, 1)]  # clipped to the field
    assert s.overlaps(5, 5) == []
    assert ShardSpec.from_sizes([1, 1, 1, 1]).overlaps(1, 3) == [(1, 1, 2), (2, 2, 3)]


def test_empty_shards():
    s = ShardSpec.from_sizes([0, 2, 0, 3])
    assert s.owner(0) == 1 and s.owner(2) == 3
    assert s.overlaps(0, 5) == [(1, 0, 2), (3, 2, 5)]
    with pytest.raises(ConfigError, match="negative"):
        ShardSpec.from_sizes([2, -1])


@pytest.mark.parametrize(
    "weights, n, want",
    [
        ((1, 1, 1, 1), 721, (180, 181, 180, 180)),  # boundaries round(721 k / 4), halves up
        ((1, 2, 1), 13, (3, 7, 3)),
        ((3, 1), 8, (6, 2)),
        ((1, 100), 10, (1, 9)),  # nudged: every shard keeps a row
        ((0.5, 0.25, 0.25), 4, (2, 1, 1)),
    ],
)
def test_from_weights(weights, n, want):
    s = ShardSpec.from_weights(weights, n)
    assert s.sizes == want and s.total == n


def test_from_weights_errors():
    with pytest.raises(ConfigError, match="cannot split 2 rows over 3 ranks"):
        ShardSpec.from_weights((1, 1, 1), 2)
    with pytest.raises(ConfigError, match="give a rank no rows"):
        ShardSpec.from_weights((1, 0, 1), 9)
    assert ShardSpec.from_weights((1, 0, 1), 9, allow_empty=True).sizes == (5, 0, 4)
    with pytest.raises(ConfigError, match="non-negative with a positive sum"):
        ShardSpec.from_weights((1, -1), 9)


def test_policies_scale_with_the_length():
    w = Weighted((1, 3))
    for n in (8, 16, 32, 721):
        s = w.spec(n, 2)
        assert s.total == n and abs(s.sizes[0] - n / 4) <= 1
    assert w(16, 2) == ShardSpec.from_sizes([4, 12])
    assert Balanced()(721, 4) == ShardSpec.balanced(721, 4)
    with pytest.raises(ConfigError, match=r"has 2 weights .* but the group has 3 ranks"):
        w.spec(10, 3)
    with pytest.raises(ConfigError, match="use at most 3 ranks"):
        Balanced().spec(3, 4)
    assert Balanced(allow_empty=True).spec(3, 4).sizes == (1, 1, 1, 0)


def test_aligned_policy_cuts_on_multiples():
    from mpidp.errors import ConfigError
    from mpidp.runtime.partition import Aligned

    assert Aligned(2).spec(26, 4).sizes == (8, 6, 6, 6)  # 13 blocks of 2: 4, 3, 3, 3
    assert Aligned(4).spec(90, 4).sizes == (24, 24, 20, 22)  # 22 blocks + 2 rows left over
    assert Aligned(3).spec(7, 1).sizes == (7,)
    for n, parts, m in [(26, 4, 2), (721, 4, 8), (100, 3, 7)]:
        spec = Aligned(m).spec(n, parts)
        assert spec.total == n and all(o % m == 0 for o in spec.offsets)
    with pytest.raises(ConfigError, match="on multiples of 8"):
        Aligned(8).spec(20, 4)
    assert Aligned(8, allow_empty=True).spec(20, 4).sizes == (8, 8, 0, 4)


def test_derived_lengths_get_empty_bands_by_default():
    """A length the model derived that the policy refuses (too few rows or whole blocks for
    the ranks) is cut by the same rule with empty parts; the input's cut still refuses."""
    from mpidp.errors import ConfigError
    from mpidp.runtime.partition import Aligned

    assert Balanced().derived(3, 4).sizes == (1, 1, 1, 0)
    assert Aligned(2).derived(6, 4).sizes == (2, 2, 2, 0)  # 3 whole blocks for 4 ranks
    assert Aligned(2).derived(26, 4) == Aligned(2).spec(26, 4)  # what the policy cuts stays
    assert Weighted((1, 2, 3, 4)).derived(3, 4).sizes == (0, 1, 1, 1)  # in proportion
    assert Weighted((1, 3)).derived(16, 2) == Weighted((1, 3)).spec(16, 2)
    for policy, n in [(Balanced(), 3), (Aligned(2), 6), (Weighted((1, 2, 3, 4)), 3)]:
        with pytest.raises(ConfigError):
            policy.spec(n, 4)
    with pytest.raises(ConfigError, match="2 weights"):  # not a length problem: raised
        Weighted((1, 2)).derived(3, 4)
