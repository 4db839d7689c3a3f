"""Element types: torch and NumPy dtypes, their file names and safetensors codes.

A dtype that safetensors has a code for is written under that code, so every
safetensors reader gets it as that dtype; any other (complex32, complex128, uint1..7,
bits*, NumPy's longdouble, ...) is written as raw ``U8`` bytes, with the real dtype kept
in aiosnap's metadata, so ``safe_open`` still reads every tensor.

safetensors counts sub-byte elements: its ``F4`` has 4 bits an element, and torch's
``float4_e2m1fn_x2`` packs two of them in each of its elements, so a tensor of that dtype
is written with its last dimension doubled (as safetensors writes it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: safetensors code -> bits per element: every code safetensors 0.8 knows
#: (``Dtype::bitsize`` in its safetensors/src/tensor.rs).
ST_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

#: torch dtype name -> the safetensors code its tensors are written under, shape for
#: shape. Names, not dtypes: torch before 2.8 has no float8_e8m0fnu.
_TORCH_ST_NAMES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
#: torch's two-F4-values-per-element dtype, written as ``F4`` with its last dimension
#: doubled; a 0-d tensor of it has no such form and is written as raw bytes.
PACKED_F4 = "float4_e2m1fn_x2"
#: Dtypes that aiosnap wrote as raw ``U8`` bytes before it wrote them under their
#: safetensors codes: a file written so still reads.
LEGACY_RAW = frozenset(("float8_e8m0fnu", PACKED_F4))

_TORCH_ST: dict[torch.dtype, str] = {
    getattr(torch, name): code for name, code in _TORCH_ST_NAMES.items() if hasattr(torch, name)
}
#: safetensors code -> the torch dtype a plain safetensors file's entry loads as (the
#: F6 codes have none).
ST_TORCH: dict[str, torch.dtype] = {code: dt for dt, code in _TORCH_ST.items()}
if hasattr(torch, PACKED_F4):
    ST_TORCH["F4"] = getattr(torch, PACKED_F4)

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


def native_st_code(name: str) -> str | None:
    """The safetensors code of a torch dtype written under it shape for shape, by name
    (torch.dtype hashes slowly); None for any other name (whose tensors are written as
    raw ``U8`` bytes or, float4_e2m1fn_x2, as ``F4``; or which is no dtype)."""
    return _ST_BY_NAME.get(name)


def torch_st_form(name: str, shape: tuple[int, ...] | list[int]) -> tuple[str, list[int]] | None:
    """The safetensors (code, shape) a torch tensor of this dtype and shape is written
    under, as safetensors writes it; None if safetensors has no form for it."""
    code = _ST_BY_NAME.get(name)
    if code is not None:
        return code, list(shape)
    if name == PACKED_F4 and shape:
        return "F4", [*shape[:-1], 2 * shape[-1]]
    return None


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


# -- sizes and safetensors entries of the dtypes in a file ----------------------------------------------

#: torch and NumPy hold sizes and strides in int64: a shape whose extent (the product of
#: its dimensions, zeros counted as ones) times the element size exceeds this is refused.
MAX_EXTENT = (1 << 63) - 1


def nbytes(shape: list[int], itemsize: int) -> int | None:
    """The bytes of a shape of non-negative ints, or None if torch or NumPy could not
    hold it (see MAX_EXTENT). Multiplies only while under that bound: a shape of
    thousand-digit numbers costs one multiplication, not a product of them all."""
    extent, empty = itemsize, False
    for d in shape:
        if d == 0:
            empty = True
        else:
            extent *= d
            if extent > MAX_EXTENT:
                return None
    return 0 if empty else extent


def itemsize(kind: str, dtype: str) -> int | None:
    """Element size of a dtype read from a file; None if it is not a valid one."""
    if kind == "tensor":
        tdt = TORCH_DTYPES.get(dtype)
        return None if tdt is None else tdt.itemsize
    npdt = numpy_from_name(dtype)
    if npdt is None or (kind == "pickle" and dtype != "|u1"):
        return None
    return npdt.itemsize


def st_entry(kind: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[str, list[int]]:
    """The safetensors (dtype code, shape) an entry is written under: its dtype's code,
    as safetensors writes that dtype, or raw bytes (``U8``, ``[nbytes]``)."""
    if kind == "tensor":
        form = torch_st_form(dtype, shape)
        return form if form is not None else ("U8", [nbytes])
    code = "U8" if kind == "pickle" else numpy_st_code(numpy_from_name(dtype))  # type: ignore[arg-type]
    native = code != "U8" or (dtype == "|u1" and kind != "pickle")
    return (code, list(shape)) if native else ("U8", [nbytes])


def st_entry_written(
    kind: str, dtype: str, shape: tuple[int, ...], nbytes: int, found: tuple[str, list[int]]
) -> bool:
    """Whether ``found``, a file's safetensors entry, is one a writer of this format
    wrote for this description: st_entry's, or for a dtype that aiosnap wrote as raw
    bytes before it wrote its code (``LEGACY_RAW``), those raw bytes."""
    if st_entry(kind, dtype, shape, nbytes) == found:
        return True
    return kind == "tensor" and dtype in LEGACY_RAW and found == ("U8", [nbytes])


def st_nbytes(code: str, shape: list[int]) -> int | None:
    """The bytes of a safetensors entry of this known code and shape of non-negative
    ints; None where torch or NumPy could not hold it (``nbytes``) or its elements do not
    fill whole bytes (a sub-byte code: safetensors refuses it too)."""
    bits = ST_BITS[code]
    if bits % 8 == 0:
        return nbytes(shape, bits // 8)
    elements = nbytes(shape, 1)
    return None if elements is None or elements * bits % 8 else elements * bits // 8


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_copyable(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as same-width integers: torch has no copy kernel for int1, uint3, ..."""
    return t.view(_SAME_WIDTH_INT.get(t.dtype.itemsize, t.dtype))
