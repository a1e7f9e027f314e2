"""Dequantize a GGUF file to float32, metadata unchanged: a like-for-like llama.cpp peer.

    .venv/bin/python scripts/gguf_to_f32.py IN.gguf OUT.gguf

DeepInfer serves the default model in float32 (dequantized from the Q4_1 GGUF it ships as);
llama.cpp on the Q4_1 file reads an eighth of the bytes per token. Benchmarks against llama.cpp
at equal precision run it on this file. Tensors keep llama.cpp's own layout (no re-permuting).
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def convert(src: str, dst: str) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer emits these itself
        if name == "general.file_type":
            writer.add_uint32(name, 0)  # all float32
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    convert(sys.argv[1], sys.argv[2])
