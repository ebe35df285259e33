"""The header of a GGUF file: metadata key/values and tensor infos, over a read-only mapping.

Layout (GGUF v2 and v3, little-endian): the magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; the metadata, each a key string, a u32 value type and the value; the tensor infos,
each a name string, u32 ``n_dims``, ``n_dims`` u64 sizes in ``ne`` order (innermost first), u32
ggml type and a u64 offset into the data section; padding to ``general.alignment`` (default 32);
the data section. A string is a u64 byte count and that many UTF-8 bytes; an array is a u32 element
type, a u64 count and the elements.

Invariants:

* The file is mapped once, read-only, as a plain ``np.ndarray`` of bytes; ``tensor_bytes`` returns
  a view of it (no copy), shaped as ``gguf.quants.dequantize`` expects: numpy order (``ne``
  reversed) with the innermost axis in bytes.
* Metadata values are plain Python: ``str``, ``int``, ``float``, ``bool`` and lists of them (lists
  of lists for arrays of arrays), in file order.
* Every read is checked against the file size before it happens, and every count is bounded by the
  bytes left, so no input hangs the parser or reads past the end (tensor bytes themselves are not
  inspected). A ValueError naming the file and the problem is raised for: a missing or empty
  file, a file cut short (with the byte offset and what was being read), a bad magic, a version
  other than 2 or 3 (a big-endian file shows as one), an unknown value or ggml type, invalid
  UTF-8, a duplicate key or tensor name, an alignment that is not a power of two, more than 4
  dimensions, a row that is not whole blocks, and tensor data that is misaligned or runs past the
  end of the file. All of it is checked on opening, before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS in llama.cpp

# struct format of each fixed-size value type; numpy reads arrays of them with the same codes.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MIN_VALUE_BYTES = 8  # a string's or an array's length prefix; scalars are checked exactly
_MIN_METADATA_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, ggml type, offset
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: ``dims`` in GGUF ``ne`` order (innermost first), ``offset`` from file start."""

    name: str
    dims: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape of the values (``dims`` reversed): ``[out, in]`` for a matrix."""
        return self.dims[::-1]


class _Cursor:
    """Reads little-endian values from ``data`` at a moving position, checking every bound."""

    def __init__(self, path: str, data: np.ndarray):
        self.path = path
        self.data = data
        self.view = memoryview(data)
        self.pos = 0

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def skip(self, nbytes: int, what: str) -> int:
        """Advance past ``nbytes``; return where they start."""
        start = self.pos
        if nbytes > len(self.data) - start:
            raise self.error(f"truncated or corrupt: {what} needs {nbytes} bytes at offset "
                             f"{start}, but the file has {len(self.data)} bytes")
        self.pos = start + nbytes
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.view, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.view, self.skip(8, what))[0]

    def check_fits(self, n: int, min_item_bytes: int, what: str) -> None:
        """Bound a count read from the file by the bytes left, so no loop over it can run long."""
        if n * min_item_bytes > len(self.data) - self.pos:
            raise self.error(f"truncated or corrupt: {n} {what} of at least {min_item_bytes} "
                             f"bytes each cannot fit in the {len(self.data) - self.pos} bytes "
                             f"left at offset {self.pos}")

    def count(self, min_item_bytes: int, what: str) -> int:
        n = self.u64(f"{what} count")
        self.check_fits(n, min_item_bytes, what)
        return n

    def string(self, what: str) -> str:
        return self.strings(1, what)[0]

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` consecutive strings: one pass finds where each lies, then all are decoded."""
        view, size, pos = self.view, len(self.data), self.pos
        spans = []
        for i in range(n):
            if pos + 8 > size or (end := pos + 8 + _U64.unpack_from(view, pos)[0]) > size:
                raise self.error(f"truncated or corrupt: string {i} of {what} at offset {pos} "
                                 f"runs past the end of the file ({size} bytes)")
            spans.append((pos + 8, end))
            pos = end
        self.pos = pos
        try:
            return [str(view[start:end], "utf-8") for start, end in spans]
        except UnicodeDecodeError as e:
            raise self.error(f"a string of {what} is not UTF-8: {e}") from e

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"{what} type")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.error(f"{what} has unknown value type {raw} "
                             f"at offset {self.pos - 4}") from None

    def value(self, value_type: GGUFValueType, what: str) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type == GGUFValueType.ARRAY:
            element_type = self.value_type(f"{what} element")
            if element_type in _SCALAR_FORMATS:
                dtype = np.dtype(_SCALAR_FORMATS[element_type])
                n = self.count(dtype.itemsize, f"{what} elements")
                start = self.skip(n * dtype.itemsize, what)
                return np.frombuffer(self.data, dtype, n, start).tolist()
            n = self.count(_MIN_VALUE_BYTES, f"{what} elements")
            if element_type == GGUFValueType.STRING:
                return self.strings(n, what)
            return [self.value(element_type, f"{what}[{i}]") for i in range(n)]
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, self.view, self.skip(struct.calcsize(fmt), what))[0]


class GGUFFile:
    """A parsed GGUF header; ``metadata`` maps key to value, ``tensors`` are in file order."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not Path(path).is_file():
            raise ValueError(f"{self.path}: file not found")
        try:
            # A plain ndarray over the mapping: slicing it is cheap, unlike slicing an np.memmap.
            data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        except (OSError, ValueError) as e:  # numpy cannot map an empty file
            raise ValueError(f"{self.path}: cannot map the file: {e}") from e
        self.data = data
        cursor = _Cursor(self.path, data)
        magic = bytes(cursor.view[cursor.skip(4, "magic"):4])
        if magic != GGUF_MAGIC:
            raise cursor.error(f"not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}")
        self.version = cursor.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise cursor.error(f"GGUF version {self.version} is not supported; expected one of "
                               f"{SUPPORTED_VERSIONS} (little-endian)")
        tensor_count = cursor.u64("tensor count")
        metadata_count = cursor.count(_MIN_METADATA_BYTES, "metadata entries")
        self.metadata: dict[str, Any] = {}
        for _ in range(metadata_count):
            key = cursor.string("metadata key")
            if key in self.metadata:
                raise cursor.error(f"metadata key {key!r} appears twice")
            self.metadata[key] = cursor.value(cursor.value_type(key), key)
        cursor.check_fits(tensor_count, _MIN_TENSOR_INFO_BYTES, "tensor infos")
        infos = [self._tensor_info_fields(cursor) for _ in range(tensor_count)]
        self.alignment = self._alignment()
        self.data_start = cursor.pos + -cursor.pos % self.alignment
        self.tensors = [self._tensor_info(*fields) for fields in infos]
        names = set()
        for tensor in self.tensors:
            if tensor.name in names:
                raise cursor.error(f"tensor {tensor.name!r} appears twice")
            names.add(tensor.name)

    def field(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of metadata ``key``; ``default`` when absent, else a ValueError."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return default

    @property
    def architecture(self) -> str:
        """``general.architecture``: the model family's name for its tensors and metadata."""
        return str(self.field("general.architecture"))

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment={alignment!r} is not a power of two")
        return alignment

    @staticmethod
    def _tensor_info_fields(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string("tensor name")
        n_dims = cursor.u32(f"tensor {name!r} dimension count")
        if n_dims > MAX_DIMS:
            raise cursor.error(f"tensor {name!r} has {n_dims} dimensions; at most {MAX_DIMS}")
        dims = tuple(cursor.u64(f"tensor {name!r} dimension {i}") for i in range(n_dims))
        return name, dims, cursor.u32(f"tensor {name!r} type"), cursor.u64(f"tensor {name!r} offset")

    def _tensor_info(self, name: str, dims: tuple[int, ...], raw_type: int,
                     relative_offset: int) -> GGUFTensorInfo:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(
                f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims and dims[0] % block_size:
            raise ValueError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole "
                             f"{ggml_type.name} blocks of {block_size}")
        nbytes = math.prod(dims) // block_size * type_size
        offset = self.data_start + relative_offset
        if relative_offset % self.alignment:
            raise ValueError(f"{self.path}: tensor {name!r} data offset {relative_offset} is not "
                             f"a multiple of the alignment {self.alignment}")
        if offset + nbytes > len(self.data):
            raise ValueError(f"{self.path}: truncated or corrupt: tensor {name!r} needs bytes "
                             f"{offset}..{offset + nbytes}, but the file has {len(self.data)}")
        return GGUFTensorInfo(name, dims, ggml_type, offset, nbytes)

    def tensor_bytes(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The raw bytes of ``tensor`` (a view), shaped ``[*shape[:-1], row bytes]``."""
        block_size, type_size = GGML_QUANT_SIZES[tensor.ggml_type]
        *outer, inner = tensor.shape or (1,)
        row_bytes = inner // block_size * type_size
        return self.data[tensor.offset:tensor.offset + tensor.nbytes].reshape(*outer, row_bytes)
