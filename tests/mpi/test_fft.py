"""mpidp.ops.fft against torch.fft of the whole field, through both transports, float64.

Each transform: the forward against torch's, the layout against the manager's policy, the
input gradient against torch's gradient of the serial transform (irfft's Hermitian weighting
included), on balanced, weighted and thin row cuts, even and odd W, three norms; ``s`` crops
and pads; gradcheck and gradgradcheck of the global function; the adjoint identity; round trips;
more ranks than modes; the number of all-to-alls.
"""

from __future__ import annotations

import pytest
import torch
from helpers import adjoint_gap, gradcheck_global, rand
from mpi4py import MPI

import mpidp.ops.fft as dfft
from mpidp.errors import ConfigError
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import count_traffic

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64
CLOSE = dict(rtol=1e-12, atol=1e-12)  # FFT sums of O(100) terms of O(1): 1e-13 seen
NORMS = ["backward", "forward", "ortho"]

# (H, W, row cut): odd and even W, 13 / 37 / 45 rows
CASES = [(13, 16, "balanced"), (37, 15, "weighted"), (45, 16, "thin"), (45, 9, "weighted")]


def rows(h: int, cut: str, p: int) -> ShardSpec:
    if cut == "balanced" or p == 1:
        return ShardSpec.balanced(h, p)
    if cut == "weighted":
        return ShardSpec.from_weights(range(p, 0, -1), h)
    return ShardSpec.from_sizes([1] * (p - 1) + [h - p + 1])


def band(full: torch.Tensor, spec: ShardSpec, rank: int, dim: int = -2) -> torch.Tensor:
    return full.narrow(dim, spec.start(rank), spec[rank])


def crand(shape, seed):
    return torch.complex(rand(shape, seed), rand(shape, seed + 1))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_rfft2_and_irfft2_equal_torch_forward_and_backward(t, manager, case, norm):
    h, w, cut = case
    spec = rows(h, cut, t.size)
    given = spec if cut != "balanced" else None  # the balanced cut is learned (all-gathered)
    full = rand((2, 3, h, w), 1)
    x = band(full, spec, t.rank).clone().requires_grad_()
    X = dfft.rfft2(x, norm=norm, group=t, manager=manager, spec=given)
    k = w // 2 + 1
    mine = dfft.modes(X)
    assert (
        mine
        == manager.partition.spec(k, t.size).slice(t.rank)
        == dfft.modes(k, manager=manager, group=t)
    )
    serial_x = full.clone().requires_grad_()
    serial_X = torch.fft.rfft2(serial_x, norm=norm)
    torch.testing.assert_close(X, serial_X[..., mine].detach(), **CLOSE)
    weight = crand(serial_X.shape, 5)  # the gradient of Re <X, G> with a complex G
    (X * weight[..., mine]).real.sum().backward()
    (serial_X * weight).real.sum().backward()
    torch.testing.assert_close(x.grad, band(serial_x.grad, spec, t.rank), **CLOSE)

    # irfft2 of a non-Hermitian spectrum: torch drops what irfft drops (DC's imaginary part)
    spectrum = crand((2, 3, h, k), 9)
    Y = spectrum[..., mine].clone().requires_grad_()
    y = dfft.irfft2(Y, s=(h, w), norm=norm, group=t, manager=manager, out_spec=spec)
    serial_Y = spectrum.clone().requires_grad_()
    serial_y = torch.fft.irfft2(serial_Y, s=(h, w), norm=norm)
    torch.testing.assert_close(y, band(serial_y, spec, t.rank).detach(), **CLOSE)
    probe = rand(serial_y.shape, 11)
    (y * band(probe, spec, t.rank)).sum().backward()
    (serial_y * probe).sum().backward()
    torch.testing.assert_close(Y.grad, serial_Y.grad[..., mine], **CLOSE)

    # and back: irfft2(rfft2(x)) is x, on the same rows
    back = dfft.irfft2(X, s=(h, w), norm=norm, group=t, manager=manager, out_spec=spec)
    torch.testing.assert_close(back, x.detach(), **CLOSE)


@pytest.mark.parametrize("s", [(10, 12), (17, 21), (-1, 11)], ids=str)
def test_s_crops_and_pads_like_torch(t, manager, s):
    h, w = 13, 16
    spec = rows(h, "thin", t.size)
    full = rand((2, h, w), 3)
    x = band(full, spec, t.rank).clone().requires_grad_()
    X = dfft.rfft2(x, s=s, norm="ortho", group=t, manager=manager, spec=spec)
    serial_x = full.clone().requires_grad_()
    serial_X = torch.fft.rfft2(serial_x, s=s, norm="ortho")
    mine = dfft.modes(X)
    assert X.shape[-2] == serial_X.shape[-2]
    torch.testing.assert_close(X, serial_X[..., mine].detach(), **CLOSE)
    weight = crand(serial_X.shape, 4)
    (X * weight[..., mine]).real.sum().backward()
    (serial_X * weight).real.sum().backward()
    torch.testing.assert_close(x.grad, band(serial_x.grad, spec, t.rank), **CLOSE)
    # the inverse crops and pads too: rows cut by the policy of the new height
    out = dfft.irfft2(X, s=(h + 2, w - 3), group=t, manager=manager)
    want = torch.fft.irfft2(serial_X.detach(), s=(h + 2, w - 3))
    out_rows = manager.partition.spec(h + 2, t.size)
    torch.testing.assert_close(out, band(want, out_rows, t.rank), **CLOSE)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_fft2_and_ifft2_of_complex_bands(t, manager, case, norm):
    h, w, cut = case
    spec = rows(h, cut, t.size)
    full = crand((2, h, w), 21)
    x = band(full, spec, t.rank).clone().requires_grad_()
    X = dfft.fft2(x, norm=norm, group=t, manager=manager)
    mine = dfft.modes(X)
    assert mine == manager.partition.spec(w, t.size).slice(t.rank)
    serial_x = full.clone().requires_grad_()
    serial_X = torch.fft.fft2(serial_x, norm=norm)
    torch.testing.assert_close(X, serial_X[..., mine].detach(), **CLOSE)
    weight = crand(serial_X.shape, 23)
    (X * weight[..., mine]).real.sum().backward()
    (serial_X * weight).real.sum().backward()
    torch.testing.assert_close(x.grad, band(serial_x.grad, spec, t.rank), **CLOSE)
    y = dfft.ifft2(X, norm=norm, group=t, manager=manager, out_spec=spec)
    torch.testing.assert_close(y, x.detach(), **CLOSE)
    # a real field through fft2 (promoted, as torch does)
    real = dfft.fft2(band(full.real, spec, t.rank), group=t, manager=manager, spec=spec)
    torch.testing.assert_close(real, torch.fft.fft2(full.real)[..., mine], **CLOSE)


@pytest.mark.parametrize("name", ["rfft", "irfft", "fft", "ifft"])
def test_one_d_transforms_along_the_sharded_dim(t, manager, name):
    h, w = 37, 6
    spec = rows(h, "weighted", t.size)
    torch_op, ours = getattr(torch.fft, name), getattr(dfft, name)
    full = rand((2, h, w), 31) if name == "rfft" else crand((2, h, w), 31)
    x = band(full, spec, t.rank).clone().requires_grad_()
    n = 2 * h - 3 if name == "irfft" else None
    y = ours(x, n=n, dim=-2, norm="ortho", group=t, manager=manager, spec=spec)
    serial_x = full.clone().requires_grad_()
    serial_y = torch_op(serial_x, n=n, dim=-2, norm="ortho")
    out_rows = manager.partition.spec(serial_y.shape[-2], t.size)
    torch.testing.assert_close(y, band(serial_y, out_rows, t.rank).detach(), **CLOSE)
    weight = crand(serial_y.shape, 33) if serial_y.is_complex() else rand(serial_y.shape, 33)
    (y * band(weight, out_rows, t.rank)).real.sum().backward()
    (serial_y * weight).real.sum().backward()
    torch.testing.assert_close(x.grad, band(serial_x.grad, spec, t.rank), **CLOSE)
    # along a local dim it is torch's own, with no communication
    with count_traffic(manager) as traffic:
        local = ours(x.detach(), dim=-1, manager=manager)
    torch.testing.assert_close(local, torch_op(x.detach(), dim=-1), rtol=0, atol=0)
    assert traffic.messages == 0
    # a 1-D field (nothing else to carry the exchange)
    line = full[0, :, 0]
    got = ours(band(line, spec, t.rank, 0), dim=0, shard_dim=0, group=t, manager=manager, spec=spec)
    want = torch_op(line, dim=0)
    torch.testing.assert_close(got, band(want, manager.spec(want.shape[0]), t.rank, 0), **CLOSE)


def _small_global(t):
    spec = ShardSpec.balanced(2 * t.size + 1, t.size)
    return spec, [(1, s, 5) for s in spec]


def test_gradcheck_rfft2_and_irfft2(t, manager):
    spec, shapes = _small_global(t)
    second = t.name == "mpi"
    gradcheck_global(
        t,
        shapes,
        lambda x: torch.view_as_real(dfft.rfft2(x, norm="ortho", group=t, manager=manager)),
        second=second,
    )
    k = 5 // 2 + 1
    modes = dfft.mode_spec(k, manager=manager, group=t)
    cshapes = [(1, spec.total, m, 2) for m in modes]

    def inverse(z):
        return dfft.irfft2(torch.view_as_complex(z), s=(spec.total, 5), group=t, manager=manager)

    gradcheck_global(t, cshapes, inverse, second=second)


def test_adjoint_identity(t, manager):
    spec = rows(13, "thin", t.size)
    x = band(rand((2, 13, 8), 41), spec, t.rank).clone().requires_grad_()
    gap = adjoint_gap(
        t, lambda v: torch.view_as_real(dfft.rfft2(v, group=t, manager=manager, spec=spec)), x
    )
    assert gap < 1e-13, gap
    k = dfft.mode_spec(5, manager=manager, group=t)
    z = rand((2, 13, k[t.rank], 2), 43).requires_grad_()
    gap = adjoint_gap(
        t,
        lambda v: dfft.irfft2(torch.view_as_complex(v), s=(13, 8), group=t, manager=manager),
        z,
    )
    assert gap < 1e-13, gap


@pytest.mark.parametrize("w", [2, 4])
def test_more_ranks_than_modes_leaves_empty_shards_that_work(t, manager, w):
    """W = 2 or 4 gives 2 or 3 modes: at 3-4 ranks the last ranks hold none, and the forward,
    the inverse and the gradient still equal torch's."""
    h = 9
    spec = ShardSpec.balanced(h, t.size)
    full = rand((1, 2, h, w), 51)
    x = band(full, spec, t.rank).clone().requires_grad_()
    X = dfft.rfft2(x, group=t, manager=manager)
    k = w // 2 + 1
    assert dfft.layout(X).spec == ShardSpec.balanced(k, t.size, allow_empty=k < t.size)
    y = dfft.irfft2(X * 2.0, s=(h, w), group=t, manager=manager)
    torch.testing.assert_close(y, 2.0 * x.detach(), **CLOSE)
    (y**2).sum().backward()
    assert torch.allclose(x.grad, 8.0 * x.detach(), rtol=1e-12, atol=1e-12)


def test_a_round_trip_is_two_all_to_alls(manager):
    """With the partitions given, rfft2 then irfft2 is exactly two all-to-alls forward and
    their two reverse exchanges backward: no gathers, no agreement steps."""
    h, w = 37, 16
    spec = manager.spec(h)
    k = dfft.mode_spec(w // 2 + 1, manager=manager)
    x = band(rand((2, 3, h, w), 61), spec, manager.domain_rank).clone().requires_grad_()
    with count_traffic(manager) as traffic:
        y = dfft.irfft2(
            dfft.rfft2(x, manager=manager, spec=spec), s=(h, w), manager=manager, spec=k
        )
        forward = {op: c for op, (c, _) in traffic.ops.items() if c}
        y.sum().backward()
    both = {op: c for op, (c, _) in traffic.ops.items() if c}
    p = manager.domain_world_size
    assert forward == ({"all_to_all_v": 2} if p > 1 else {})
    assert both == ({"all_to_all_v": 4} if p > 1 else {})


def test_errors_name_the_fix(t, manager):
    x = torch.zeros(2, manager.spec(13)[t.rank], 8, dtype=F64)
    if t.size > 1:
        with pytest.raises(ConfigError, match="halves the local dim; pass dim=\\(1, 2\\)"):
            dfft.rfft2(x, dim=(-1, -2), group=t, manager=manager)
    with pytest.raises(ConfigError, match=f"{t.size + 1} parts for a group of {t.size}"):
        dfft.rfft2(x, group=t, manager=manager, spec=[13] + [0] * t.size)
    if t.size > 1:
        with pytest.raises(ConfigError, match="entries along dim 1, but the tensor"):
            dfft.rfft2(x, group=t, manager=manager, spec=[0] * (t.size - 1) + [13])
    with pytest.raises(ConfigError, match="carries no spectral layout"):
        dfft.modes(torch.zeros(3))
    with pytest.raises(ConfigError, match="do not name two different dims"):
        dfft.rfft2(x, dim=(-2, -2), group=t, manager=manager)


def test_physicsnemo_call_shape(manager):
    """``DistributedRFFT2.apply(x, s, dim, norm)`` computes torch.fft.rfft2 exactly, its layout
    mpidp's; PhysicsNeMo's own dim order (halve the sharded dim) is refused with the fix."""
    h, w = 13, 10
    spec = manager.spec(h)
    full = rand((1, 2, h, w), 71)
    me = manager.domain_rank
    X = dfft.DistributedRFFT2.apply(
        band(full, spec, me), (h, w), (-2, -1), "ortho", manager=manager
    )
    torch.testing.assert_close(X, torch.fft.rfft2(full, norm="ortho")[..., dfft.modes(X)], **CLOSE)
    y = dfft.DistributedIRFFT2.apply(X, (h, w), (-2, -1), "ortho", manager=manager)
    torch.testing.assert_close(y, band(full, spec, me), **CLOSE)
    if manager.domain_world_size > 1:
        with pytest.raises(ConfigError, match="halves the local dim"):
            dfft.DistributedRFFT2.apply(
                band(full, spec, me), (w, h), (-1, -2), "ortho", manager=manager
            )


def test_float32_and_complex64(t, manager):
    h, w = 13, 9
    spec = manager.spec(h)
    full = rand((2, h, w), 81)
    X = dfft.rfft2(band(full, spec, t.rank).float(), group=t, manager=manager)
    assert X.dtype == torch.complex64
    want = torch.fft.rfft2(full)[..., dfft.modes(X)]
    serial32 = torch.fft.rfft2(full.float())[..., dfft.modes(X)]
    # as accurate as torch's own float32 transform (within 2x and one eps of the scale)
    err, err_serial = (X.to(torch.complex128) - want).abs().max(), (serial32 - want).abs().max()
    assert err <= 2 * err_serial + 1e-6 * want.abs().max(), (err, err_serial)
