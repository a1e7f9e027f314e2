"""A GGUF file's metadata and tensor index, read straight from its bytes, and its tensors as
views of one copy-on-write memory map.

gguf-py's GGUFReader builds every field through numpy.memmap slices: ~10-25 s here for a file
with a 49k-token vocabulary (half a million memmap views for the tokenizer's strings), paid by
every worker at every start. This reads the same layout (GGUF v2/v3: header, key/values, tensor
infos, aligned data) with `struct` over one mapping in a fraction of a second, and hands out the
same `ReaderTensor`s (name, GGUF dims, type, data shaped as gguf-py shapes it), so the code that
reads tensors is unchanged. Every offset and size is checked against the file before use.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

from deepinfer.engine.model_store.errors import ModelPrepareError

MAGIC = 0x46554747  # "GGUF" little-endian
DEFAULT_ALIGNMENT = 32
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_ELEMENT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ModelPrepareError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ModelPrepareError(f"{self.path}: a string runs past the end of the file")
        value = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.take("I")), self.take("Q")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = f"{count}{_SCALARS[item]}"
                if self.pos + struct.calcsize("<" + fmt) > len(self.buf):
                    raise ModelPrepareError(f"{self.path}: an array runs past the end")
                values = list(struct.unpack_from("<" + fmt, self.buf, self.pos))
                self.pos += struct.calcsize("<" + fmt)
                return values
            return [self.value(item) for _ in range(count)]
        return self.take(_SCALARS[vtype])


@dataclass
class GGUFIndex:
    metadata: dict[str, Any]
    tensors: list[ReaderTensor]


def read_index(path: str) -> GGUFIndex:
    """The file's key/values (scalars as themselves, arrays as lists, as gguf_metadata's
    read_metadata gives them) and its tensors over a copy-on-write map (never written)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data = np.frombuffer(mapped, dtype=np.uint8)  # writable (copy-on-write) and zero-copy
    cur = _Cursor(memoryview(mapped), path)
    if cur.take("I") != MAGIC:
        raise ModelPrepareError(f"{path} is not a GGUF file (bad magic)")
    version = cur.take("I")
    if version not in (2, 3):
        raise ModelPrepareError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    # (gguf-py lists the header's counts as fields too)
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                                "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, qtype, offset in infos:
        if name in names:
            raise ModelPrepareError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(data, path, name, dims, qtype, start + offset))
    return GGUFIndex(metadata, tensors)


def _tensor(data: np.ndarray, path: str, name: str, dims: list[int],
            qtype: GGMLQuantizationType, at: int) -> ReaderTensor:
    n_elems = int(np.prod(dims)) if dims else 1
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n_elems % block:
        raise ModelPrepareError(f"{path}: tensor {name!r} is not whole {qtype.name} blocks")
    n_bytes = n_elems * type_size // block
    if at + n_bytes > data.size:
        raise ModelPrepareError(f"{path}: tensor {name!r} runs past the end of the file")
    np_dims = tuple(reversed(dims))
    raw = data[at:at + n_bytes]
    if qtype in _ELEMENT_DTYPES:
        view = raw.view(_ELEMENT_DTYPES[qtype]).reshape(np_dims)
    else:
        view = raw.reshape(quant_shape_to_byte_shape(np_dims, qtype))
    return ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64),
                        n_elements=n_elems, n_bytes=n_bytes, data_offset=at, data=view,
                        field=None)
