"""Resident memory of the worker process per model and per `--cpu-linear-weights` choice.

    .venv/bin/python scripts/bench_worker_memory.py [--model DIR_OR_NAME ...] \
        [--copies both,packed,plain] [--random-0.5b]

Starts the offline engine (the same processes as the server) with a small fixed KV cache, runs
one short generation so every lazy buffer exists, and reads the worker's VmRSS and VmHWM from
/proc. `--random-0.5b` also measures a random Qwen2-0.5B-shaped Llama (hidden 896, 24 layers,
151,936-token vocabulary, ~0.5 B parameters, 2 GB of float32 weights), written once to a temp
directory: the size where the second copy of every linear weight starts to matter.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from deepinfer import LLM, SamplingParams


def worker_memory_mb(llm: LLM) -> tuple[float, float]:
    pid = llm.client.launcher.procs["worker0"].pid
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    kb = lambda key: int(fields[key].split()[0])
    return kb("VmRSS") / 1024, kb("VmHWM") / 1024


def measure(model: str, copies: str) -> dict:
    with LLM(model, num_kv_blocks=64, cpu_linear_weights=copies) as llm:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0))
        rss, peak = worker_memory_mb(llm)
    return {"model": Path(model).name, "copies": copies, "rss_mb": round(rss),
            "peak_mb": round(peak)}


def random_half_billion(out: Path) -> str:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, rms_norm_eps=1e-6)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.float32)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(str(out), safe_serialization=True)
    from deepinfer.engine.config import EngineConfig

    src = Path(EngineConfig().resolved_model_dir())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", action="append", default=None)
    p.add_argument("--copies", default="both,packed,plain")
    p.add_argument("--random-0.5b", dest="random_half", action="store_true")
    args = p.parse_args()
    models = args.model or ["default"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_half:
            models.append(random_half_billion(Path(tmp) / "random-llama-0.5b"))
        for model in models:
            for copies in args.copies.split(","):
                results.append(measure(model, copies))
                print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
