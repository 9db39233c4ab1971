"""The dtypes a tensor entry may have, by stable name.

Entries are stored as raw little-endian bytes plus a dtype name; the name,
not numpy's repr, is the format.  bfloat16 and the float8 family come from
``ml_dtypes`` (the same types JAX and torch's numpy bridge use).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from chunkstore.errors import UnsupportedDtypeError

_NUMPY = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "complex64": np.dtype("<c8"),
    "complex128": np.dtype("<c16"),
}
_EXTENDED = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
DTYPES: dict[str, np.dtype] = {**_NUMPY, **_EXTENDED}
_BY_DTYPE = {dt: name for name, dt in DTYPES.items()}
FLOAT_NAMES = frozenset(
    {"float16", "float32", "float64", "complex64", "complex128", "bfloat16"}
)


def dtype_name(dtype: np.dtype) -> str:
    """Return the stable name of ``dtype``; big-endian inputs map to their LE name."""
    canonical = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    name = _BY_DTYPE.get(canonical)
    if name is None:
        raise UnsupportedDtypeError(
            str(dtype), f"supported are {', '.join(sorted(DTYPES))}"
        )
    return name


def numpy_dtype(name: str) -> np.dtype:
    """Return the numpy dtype stored under ``name``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedDtypeError(
            name, "written by a newer chunkstore or a damaged manifest"
        ) from None


def element_size(name: str) -> int:
    return numpy_dtype(name).itemsize


def check_override(array_dtype: np.dtype, name: str) -> None:
    """Allow storing e.g. a ``uint16`` view of bf16 bytes under the name ``bfloat16``."""
    target = numpy_dtype(name)
    if target.itemsize != array_dtype.itemsize:
        raise UnsupportedDtypeError(
            name,
            f"the array's elements are {array_dtype.itemsize} bytes,"
            f" {name} needs {target.itemsize}",
        )
