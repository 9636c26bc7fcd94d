"""NaN / Inf detection in source tensors, by exponent bits (no float conversion of bf16 / fp8 data).

A float is NaN or Inf when its exponent field is all ones (float8_e4m3fn has no Inf and spells NaN as
S.1111.111). The test runs over cache-sized chunks of the raw bits, so it costs a small fraction of
reading the tensor.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from convert.errors import CheckpointError

# dtype -> (unsigned view, mask of the bits that are all ones exactly for NaN / Inf)
NONFINITE_BITS = {
    np.dtype(np.float64): (np.uint64, 0x7FF0_0000_0000_0000),
    np.dtype(np.float32): (np.uint32, 0x7F80_0000),
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, 0x7C),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, 0x7F),
}
CHUNK_ELEMENTS = 1 << 16


def has_nonfinite(x: np.ndarray) -> bool:
    bits = NONFINITE_BITS.get(x.dtype)
    if bits is None or x.size == 0:
        return False
    utype, mask = bits
    flat = np.ascontiguousarray(x).reshape(-1).view(utype)
    buf = np.empty(min(CHUNK_ELEMENTS, flat.size), utype)
    for i in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[i:i + CHUNK_ELEMENTS]
        out = buf[:chunk.size]
        np.bitwise_and(chunk, mask, out=out)
        if out.max() == mask:
            return True
    return False


def count_nonfinite(x: np.ndarray) -> int:
    bits = NONFINITE_BITS.get(x.dtype)
    if bits is None:
        return 0
    utype, mask = bits
    return int(np.count_nonzero((np.ascontiguousarray(x).reshape(-1).view(utype) & mask) == mask))


def refuse_nonfinite(name: str, x: np.ndarray, source) -> None:
    """An `ObservedSource` observer: a float tensor holding NaN or Inf is refused, naming its file and name."""
    if has_nonfinite(x):
        raise CheckpointError(
            f"{source.file_of(name)}: tensor '{name}' holds {count_nonfinite(x)} NaN / Inf values "
            "(pass --allow-nonfinite to convert it anyway)"
        )
