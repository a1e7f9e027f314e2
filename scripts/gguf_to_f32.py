"""Dequantize a GGUF file to float32 (or re-quantize its matrices to Q8_0), metadata unchanged:
like-for-like llama.cpp peers.

    .venv/bin/python scripts/gguf_to_f32.py IN.gguf OUT.gguf [F32|Q8_0]

DeepInfer serves the default model in float32 (dequantized from the Q4_1 GGUF it ships as);
llama.cpp on the Q4_1 file reads an eighth of the bytes per token. Benchmarks against llama.cpp
at equal precision run it on this file. Tensors keep llama.cpp's own layout (no re-permuting).
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

# llama.cpp's general.file_type values (LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_Q8_0)
FILE_TYPES = {"F32": 0, "Q8_0": 7}


def convert(src: str, dst: str, out_type: str = "F32") -> None:
    """Q8_0: every matrix (rows a whole number of 32-blocks) in Q8_0, vectors in F32, as
    llama-quantize writes a Q8_0 file."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer emits these itself
        if name == "general.file_type":
            writer.add_uint32(name, FILE_TYPES[out_type])
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    q8 = GGMLQuantizationType.Q8_0
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)])
        if out_type == "Q8_0" and data.ndim == 2 and data.shape[-1] % 32 == 0:
            packed = quantize(data, q8)
            writer.add_tensor(t.name, packed, raw_shape=packed.shape, raw_dtype=q8)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    convert(sys.argv[1], sys.argv[2], *sys.argv[3:4])
