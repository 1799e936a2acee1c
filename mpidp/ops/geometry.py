"""Layer geometry: the global input rows each rank needs for the output rows it owns.

For a convolution (or pooling) along the sharded dim, output row ``o`` reads input rows
``o * stride - pad_lo + dilation * k`` for ``k`` in ``0 .. kernel_size - 1``. A rank owning
output rows ``[os, oe)`` therefore needs input rows ``[os * stride - pad_lo,
(oe - 1) * stride - pad_lo + dilation * (kernel_size - 1) + 1)``: a range that may reach
beyond the field (the padding, filled by the halo boundary), above and below by different
amounts, and may leave some of the rank's own rows unused (negative widths). A transposed
convolution scatters input row ``i`` to output rows ``i * stride - pad_lo + dilation * k``;
the rows a rank needs are those that reach its outputs.

:class:`HaloSpec` turns the ranges into per-rank ``before`` / ``after`` widths for
:func:`mpidp.halo_exchange`. Everything here is pure arithmetic, the same on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mpidp.errors import ConfigError
from mpidp.runtime.partition import Balanced, PartitionPolicy, ShardSpec

__all__ = ["HaloSpec", "conv_output_size", "input_ranges", "padding_pair"]

Padding = int | str | tuple[int, int]
Spec = ShardSpec | Sequence[int]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padding_pair(
    padding: Padding, kernel_size: int, stride: int = 1, dilation: int = 1
) -> tuple[int, int]:
    """``(low, high)`` padding from an int, a pair, ``"valid"`` or ``"same"`` (torch's rule:
    the odd extra row of an even kernel goes to the high end; stride 1 only)."""
    if padding == "valid":
        return 0, 0
    if padding == "same":
        if stride != 1:
            raise ConfigError(f"padding='same' needs stride 1 (as in torch), got stride {stride}")
        total = dilation * (kernel_size - 1)
        return total // 2, total - total // 2
    if isinstance(padding, int):
        return padding, padding
    if isinstance(padding, Sequence) and not isinstance(padding, str) and len(padding) == 2:
        return int(padding[0]), int(padding[1])
    raise ConfigError(f"padding={padding!r}: use an int, a (low, high) pair, 'same' or 'valid'")


def conv_output_size(
    n: int,
    kernel_size: int,
    stride: int = 1,
    padding: Padding = 0,
    dilation: int = 1,
    *,
    transposed: bool = False,
    output_padding: int = 0,
) -> int:
    """Output length of a (transposed) convolution or pooling over ``n`` rows (as torch)."""
    lo, hi = padding_pair(padding, kernel_size, stride, dilation)
    span = dilation * (kernel_size - 1)
    if transposed:
        return (n - 1) * stride - lo - hi + span + output_padding + 1
    return (n + lo + hi - span - 1) // stride + 1


def _spec(spec: Spec | PartitionPolicy | None, n: int, parts: int) -> ShardSpec:
    if spec is None or isinstance(spec, PartitionPolicy):
        return (spec or Balanced()).spec(n, parts)
    return spec if isinstance(spec, ShardSpec) else ShardSpec.from_sizes(spec)


def input_ranges(
    in_spec: Spec,
    out_spec: Spec | PartitionPolicy | None,
    kernel_size: int,
    stride: int = 1,
    padding: Padding = 0,
    dilation: int = 1,
    *,
    transposed: bool = False,
    output_padding: int = 0,
) -> list[tuple[int, int]]:
    """Global input rows ``[lo, hi)`` each rank needs to compute the output rows it owns.

    ``out_spec`` is the partition of the output (a ShardSpec or sizes), or a partition policy
    (None: balanced) applied to the output length. Ranges may reach outside ``[0, n)``: those
    rows are padding. A rank that owns no output rows, or whose outputs read no input (a
    transposed convolution with stride > kernel), gets an empty range.
    """
    in_spec = _spec(in_spec, 0, 1)
    if min(kernel_size, stride, dilation) < 1:
        raise ConfigError(
            f"kernel_size={kernel_size}, stride={stride}, dilation={dilation}: each must be >= 1"
        )
    if transposed and not 0 <= output_padding < max(stride, dilation):
        raise ConfigError(
            f"output_padding={output_padding} must be in [0, max(stride, dilation)) = "
            f"[0, {max(stride, dilation)}) (as in torch)"
        )
    n = in_spec.total
    n_out = conv_output_size(
        n,
        kernel_size,
        stride,
        padding,
        dilation,
        transposed=transposed,
        output_padding=output_padding,
    )
    if n_out < 1:
        raise ConfigError(
            f"a layer with kernel_size={kernel_size}, stride={stride}, padding={padding!r}, "
            f"dilation={dilation} gives {n_out} output rows from {n}; the input is too small"
        )
    out_spec = _spec(out_spec, n_out, in_spec.parts)
    if out_spec.total != n_out or out_spec.parts != in_spec.parts:
        raise ConfigError(
            f"output partition {out_spec} does not fit this layer: {n} input rows over "
            f"{in_spec.parts} ranks give {n_out} output rows; pass a partition of {n_out} rows "
            f"over {in_spec.parts} ranks"
        )
    lo_pad, _ = padding_pair(padding, kernel_size, stride, dilation)
    span = dilation * (kernel_size - 1)
    ranges = []
    for start, size in zip(out_spec.offsets, out_spec.sizes, strict=True):
        stop = start + size
        if transposed:
            lo = _ceil_div(start + lo_pad - span, stride)
            hi = (stop - 1 + lo_pad) // stride + 1
            lo, hi = max(lo, 0), min(hi, n)  # beyond the input nothing is scattered
        else:
            lo, hi = start * stride - lo_pad, (stop - 1) * stride - lo_pad + span + 1
        if size == 0 or hi <= lo:
            anchor = min(max(lo, 0), n)
            lo = hi = anchor
        ranges.append((lo, hi))
    return ranges


@dataclasses.dataclass(frozen=True)
class HaloSpec:
    """Per-rank halo widths: rank r extends its band by ``before[r]`` rows at its low end and
    ``after[r]`` at its high end (negative: drops rows). Pass both to
    :func:`mpidp.halo_exchange` (``halo_exchange(x, h.before, h.after, spec=in_spec)``)."""

    before: tuple[int, ...]
    after: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "before", tuple(int(b) for b in self.before))
        object.__setattr__(self, "after", tuple(int(a) for a in self.after))
        if len(self.before) != len(self.after):
            raise ConfigError(
                f"HaloSpec needs one before and one after width per rank; got "
                f"{len(self.before)} and {len(self.after)}"
            )

    @classmethod
    def from_ranges(cls, in_spec: Spec, ranges: Sequence[tuple[int, int]]) -> HaloSpec:
        """Widths that turn each rank's band of ``in_spec`` into its range ``[lo, hi)``."""
        in_spec = _spec(in_spec, 0, 1)
        if len(ranges) != in_spec.parts:
            raise ConfigError(f"{len(ranges)} ranges for {in_spec.parts} ranks; pass one per rank")
        return cls(
            tuple(s - lo for s, (lo, _) in zip(in_spec.offsets, ranges, strict=True)),
            tuple(
                hi - (s + n)
                for s, n, (_, hi) in zip(in_spec.offsets, in_spec.sizes, ranges, strict=True)
            ),
        )

    @classmethod
    def for_layer(
        cls,
        in_spec: Spec,
        out_spec: Spec | PartitionPolicy | None,
        kernel_size: int,
        stride: int = 1,
        padding: Padding = 0,
        dilation: int = 1,
        *,
        transposed: bool = False,
        output_padding: int = 0,
    ) -> HaloSpec:
        """The widths of a (transposed) convolution or pooling layer (see :func:`input_ranges`)."""
        ranges = input_ranges(
            in_spec,
            out_spec,
            kernel_size,
            stride,
            padding,
            dilation,
            transposed=transposed,
            output_padding=output_padding,
        )
        return cls.from_ranges(in_spec, ranges)

    def ranges(self, in_spec: Spec) -> list[tuple[int, int]]:
        """Global rows ``[lo, hi)`` each rank holds after the exchange."""
        in_spec = _spec(in_spec, 0, 1)
        return [
            (s - b, s + n + a)
            for s, n, b, a in zip(
                in_spec.offsets, in_spec.sizes, self.before, self.after, strict=True
            )
        ]
