"""One GGUF file -> a Hugging Face model directory (float32 safetensors, config, tokenizer).

No torch and no transformers: numpy, gguf, safetensors and tokenizers only, so a plain
`pip install deepinfer` can prepare its models (transformers >= 5.25 pulls in a distribution
whose top-level package `kernels` collides with DeepInfer's own).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gguf import GGUFReader
from safetensors.numpy import save_file
from tqdm import tqdm

from deepinfer.engine.model_store.gguf_config import generation_config, model_config
from deepinfer.engine.model_store.gguf_metadata import read_metadata
from deepinfer.engine.model_store.gguf_tokenizer import write_tokenizer
from deepinfer.engine.model_store.gguf_weights import hf_tensors, tensor_count


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files of
    `gguf_path` into the existing directory `out`."""
    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    config = model_config(meta, {t.name for t in reader.tensors})
    # The tokenizer first: an unsupported one fails before minutes of dequantizing.
    write_tokenizer(meta, out)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    bar = tqdm(hf_tensors(reader, meta["general.architecture"], heads, kv_heads),
               total=tensor_count(reader),
               desc=f"dequantizing {gguf_path.name}", unit="tensor", file=sys.stderr,
               disable=not progress)
    tensors = dict(bar)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(meta))
