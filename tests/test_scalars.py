"""A decode step's small per-layer inputs are made once per value."""

import mlx.core as mx

from qwen38_backend import scalars


def test_int32_scalars_hold_their_value_and_are_shared():
    a = scalars.int32(4097)
    assert a.dtype == mx.int32 and a.shape == () and a.item() == 4097
    assert scalars.int32(4097) is a  # the next layer of the step gets the same array
    assert scalars.int32(4098).item() == 4098


def test_int32_arrays_hold_their_values():
    a = scalars.int32s((5, -1, 7))
    assert a.dtype == mx.int32 and a.shape == (3,) and a.tolist() == [5, -1, 7]
    assert scalars.int32s((5, -1, 7)) is a
