"""Element types: torch and NumPy dtypes, their file names and safetensors codes.

A dtype that safetensors has a code for is written under that code; any other
(complex32, complex128, uint1..7, bits*, NumPy's longdouble, ...) is written as raw
``U8`` bytes, with the real dtype kept in aiosnap's metadata, so ``safe_open`` still
reads every tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: safetensors code -> element size in bytes.
ST_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

_TORCH_ST: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
ST_TORCH: dict[str, torch.dtype] = {code: dt for dt, code in _TORCH_ST.items()}

_NUMPY_ST: dict[str, str] = {
    "|b1": "BOOL",
    "|u1": "U8",
    "|i1": "I8",
    "<i2": "I16",
    "<u2": "U16",
    "<f2": "F16",
    "<i4": "I32",
    "<u4": "U32",
    "<f4": "F32",
    "<i8": "I64",
    "<u8": "U64",
    "<f8": "F64",
    "<c8": "C64",
}

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _all_torch_dtypes() -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr)
        if isinstance(value, torch.dtype) and value not in _QUANTIZED:
            found.setdefault(str(value).removeprefix("torch."), value)
    return found


#: Every plain (non-quantized) torch dtype, by the name written to files.
TORCH_DTYPES: dict[str, torch.dtype] = _all_torch_dtypes()


_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def torch_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


_ST_BY_NAME = {str(dt).removeprefix("torch."): code for dt, code in _TORCH_ST.items()}


def torch_st_code(name: str) -> str:
    """The safetensors code of a torch dtype, by name (torch.dtype hashes slowly)."""
    return _ST_BY_NAME.get(name, "U8")


def native_st_code(name: str) -> str | None:
    """The safetensors code of a torch dtype that has one, by name; None for any other
    name (whose tensors are written as raw ``U8`` bytes, or which is no dtype)."""
    return _ST_BY_NAME.get(name)


def is_storable_torch(dtype: torch.dtype) -> bool:
    return dtype not in _QUANTIZED


def numpy_file_dtype(dtype: np.dtype[Any]) -> np.dtype[Any] | None:
    """The dtype an array is written as, or None if it has no raw form. Big-endian
    arrays keep their byte order (raw ``U8`` bytes to safetensors), so they load back
    exactly as they were."""
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.itemsize == 0:
        return None
    return dtype


def numpy_st_code(dtype: np.dtype[Any]) -> str:
    return _NUMPY_ST.get(dtype.str, "U8")


def numpy_from_name(name: str) -> np.dtype[Any] | None:
    """Parse a dtype read from a file; None if it is not one aiosnap writes."""
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        return None
    if numpy_file_dtype(dtype) != dtype or dtype.str != name:
        return None
    return dtype
