"""A GGUF file's header read in one pass: metadata as Python values, tensors as views of a memory map.

`gguf.GGUFReader` builds a numpy view for every item of every metadata array, which for SmolLM2's 49k-token
vocabulary and 48k merges is seconds of Python; this reads the same header with `struct` (tens of
milliseconds) and keeps only what the loader asks for. The tensors' `data` are the same views GGUFReader gives
(typed for F32/F16/..., bytes per row for block types), so gguf's `dequantize` takes them unchanged.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, either byte order).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_VT = gguf.GGUFValueType
# scalar value types -> struct format (without byte order) and numpy dtype
_SCALARS = {_VT.UINT8: ("B", np.uint8), _VT.INT8: ("b", np.int8), _VT.UINT16: ("H", np.uint16),
            _VT.INT16: ("h", np.int16), _VT.UINT32: ("I", np.uint32), _VT.INT32: ("i", np.int32),
            _VT.FLOAT32: ("f", np.float32), _VT.BOOL: ("?", np.bool_), _VT.UINT64: ("Q", np.uint64),
            _VT.INT64: ("q", np.int64), _VT.FLOAT64: ("d", np.float64)}
_Q = gguf.GGMLQuantizationType
# tensor types stored as plain numbers: GGUFReader's typed views; every other type is blocks of bytes
_PLAIN = {_Q.F32: np.float32, _Q.F16: np.float16, _Q.F64: np.float64, _Q.I8: np.int8, _Q.I16: np.int16,
          _Q.I32: np.int32, _Q.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as GGUFReader's ReaderTensor has it: `shape` fastest dimension first (ggml's ne[])."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The header of one GGUF file: `fields` (key -> value: int, float, bool, str or a list of them) and
    `tensors`, in file order.

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a header that runs past the file's end.
    """

    def __init__(self, path: str):
        self.path = path
        self.data = np.memmap(path, mode="r")
        try:
            self.fields, self.tensors = _parse(self.data, path)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({exc})") from exc

    def field(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value


class _Cursor:
    """Reads a header front to back with one byte order."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.offset = buf, order, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        start, self.offset = self.offset, self.offset + size
        if self.offset > len(self.buf):
            raise IndexError("string past the end of the file")
        return bytes(self.buf[start:self.offset]).decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _VT.STRING:
            return self.string()
        if value_type == _VT.ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type == _VT.STRING:
                return [self.string() for _ in range(count)]
            if item_type == _VT.ARRAY:
                return [self.value(_VT.ARRAY) for _ in range(count)]
            dtype = np.dtype(_scalar(item_type)[1]).newbyteorder(self.order)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset)
            self.offset += values.nbytes
            return values.tolist()
        return self.scalar(_scalar(value_type)[0])


def _scalar(value_type: int) -> tuple[str, type]:
    try:
        return _SCALARS[_VT(value_type)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown GGUF value type {value_type}") from None


def _parse(data: np.ndarray, path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    buf = memoryview(data) if len(data) else b""
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    # A version whose low 16 bits are zero was written in the other byte order (as GGUFReader decides).
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    cursor = _Cursor(buf, order)
    cursor.offset = 4
    version = cursor.scalar("I")
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (only {_SUPPORTED_VERSIONS})")
    num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
        infos.append((name, dims, cursor.scalar("I"), cursor.scalar("Q")))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.offset // alignment) * alignment
    return fields, _tensors(data, infos, start, order, path)


def _tensors(data: np.ndarray, infos: list, start: int, order: str, path: str) -> list[GGUFTensor]:
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"{path}: tensor {name} appears twice")
        seen.add(name)
        tensor_type = _Q(raw_type)
        n_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block_size
        np_dims = tuple(reversed(dims))
        if tensor_type in _PLAIN:
            dtype, count = np.dtype(_PLAIN[tensor_type]).newbyteorder(order), n_elements
        else:
            dtype, count = np.dtype(np.uint8), n_bytes
            np_dims = gguf.quant_shape_to_byte_shape(np_dims, tensor_type)
        at = start + offset
        if at + n_bytes > len(data):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        view = data[at:at + n_bytes].view(dtype)[:count].reshape(np_dims)
        tensors.append(GGUFTensor(name, tensor_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes, at, view))
    return tensors
