"""CF packing as xarray decodes it (mpidp.io.source.packing): scale, offset and the missing
numbers, compared in the stored type; the fill value forms HDF5 and Zarr attributes take."""

from __future__ import annotations

import base64

import numpy as np

from mpidp.io.source import Packing, packing


class _Array:
    def __init__(self, dtype, **attrs) -> None:
        self.dtype, self.attrs = np.dtype(dtype), attrs


def test_scale_offset_and_missing_numbers():
    p = packing(_Array("i2", scale_factor=np.float32(0.5), add_offset=10.0, _FillValue=-32767))
    assert p == Packing(0.5, 10.0, (-32767.0,))
    got = p.apply(np.array([-32767, 0, 4], np.int16))
    np.testing.assert_array_equal(got, [np.nan, 10.0, 12.0])
    assert got.dtype == np.float64


def test_a_float32_missing_number_is_compared_as_float32():
    p = packing(_Array("f4", missing_value=np.float32(1e20)))
    np.testing.assert_array_equal(p.apply(np.array([1e20, 2.0], np.float32)), [np.nan, 2.0])


def test_values_stored_as_they_are_need_nothing():
    assert packing(_Array("f4", units="K")) is None
    assert packing(_Array("f4", _FillValue=np.float32(np.nan))) is None


def test_xarray_zarr3_base64_fill_value():
    """xarray writes a float fill value into Zarr format 3 as the base64 of a float64."""
    text = base64.b64encode(np.array(-9999.0, "<f8").tobytes()).decode()
    assert packing(_Array("f4", _FillValue=text)) == Packing(missing=(-9999.0,))
    assert packing(_Array("f4", _FillValue="not base64!")) is None
