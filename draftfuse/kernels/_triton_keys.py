"""Order keys, shared by the selection kernels (_triton_selection.py, _triton_argmax.py): a float as an int32
whose signed order is torch's order of floats (NaN above +inf, -0.0 == +0.0), packed with its index into
an int64 whose max picks the larger value and, on ties, the lower index; and the move of a floor from the
order of y = x * s to that of u = x * sign(s).
"""

import triton
import triton.language as tl

_NO_KEY = tl.constexpr(-(2**31))  # int32 below every element's order key: the workspace's idle value
_EMPTY = tl.constexpr(-(2**63))  # int64 below every packed key
_NAN_KEY = tl.constexpr(2**31 - 1)


@triton.jit
def _order_key(x):
    """float32 -> int32 whose signed order is torch's order of the floats."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(2**31), 0, bits)  # -0.0 ties with +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    return tl.where(x != x, _NAN_KEY, key)  # every NaN above +inf


@triton.jit
def _pack(key, index):
    # the low word holds 2**31 - 1 - index, so among equal keys the lower index packs larger
    return (key.to(tl.int64) << 32) | tl.cast(0x7FFFFFFF - index, tl.int64)  # index may be a scalar


@triton.jit
def _key_value(key):
    """The float32 of an order key (_order_key's inverse, but for -0.0 and NaN's payload)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _unpack(packed):
    index = 0x7FFFFFFF - (packed & 0x7FFFFFFF).to(tl.int32)
    return _key_value((packed >> 32).to(tl.int32)), index


@triton.jit
def _u_floor(floor, s_abs):
    """The floor of pass 2's hits in u = x * sign(s) from the row's floor in y = u * |s| (order keys): at or
    under the key of every u whose y reaches it, so each element of the y floor's is a hit (and maybe a
    rounding tie more: candidates are real elements, ranked by u). y = fl(u * |s|) >= f needs u * |s| >=
    f - ulp(f), so u >= (f - ulp(f)) / |s|: taken with 4 ulp to spare (each step, the division's own error
    too) and 2**-126 (denormals). No floor for s = 0 or NaN (y ties everything there); NaN stays NaN."""
    f = tl.minimum(_key_value(floor), 3.4028234663852886e38)  # y = +inf: u * |s| > FLT_MAX
    c = tl.minimum((f - tl.abs(f) * 2.0**-21 - 2.0**-126) / s_abs, 3.4028234663852886e38)
    key = _order_key(c - tl.abs(c) * 2.0**-21 - 2.0**-126)
    key = tl.where((floor == _NO_KEY) | (floor == _NAN_KEY), floor, key)
    return tl.where(s_abs > 0, key, _NO_KEY)
