"""The whole engine on a GPU against the same engine on the CPU (scripts/gpu_check.sh runs it).

For each run (the CPU; the first GPU with CUDA graphs and without (--enforce-eager); tensor
parallelism over two GPUs when there are two):
greedy token ids of --prompts prompts, --max-tokens each, EOS ignored, compared with the first
run's (identical, or the first position that differs); then batch-1 decode tok/s and the output
tok/s of --concurrency requests at once (bench_peers.py's definitions). One JSON line per run,
then a summary; exit status 1 when a run's greedy tokens differ from the first's.

The model: --model (a directory, or a named model already prepared). The device machines reach
no model hub, so with --random-from DIR the script writes a Llama with DIR's config.json and
tokenizer files and random weights (std --init-std, wide enough that greedy picks are not
near-ties) into --work-dir and runs that.

    .venv/bin/python scripts/gpu_engine_check.py --devices cpu,cuda --model default
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for scripts.*, after site-packages

from deepinfer import LLM  # noqa: E402
from deepinfer.engine.protocol import SamplingParams  # noqa: E402
from scripts.bench_peers import measure_batch, measure_batch1  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")


def random_llama(source: Path, out: Path, std: float, seed: int = 0) -> Path:
    """A Llama checkpoint shaped by source/config.json, random N(0, std) weights (norms 1)."""
    from safetensors.torch import save_file

    cfg = json.loads((source / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, hidden),
                       p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden),
                       p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    tensors = {name: torch.ones(shape) if len(shape) == 1
               else torch.randn(shape, generator=gen) * std for name, shape in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def run(model: str, device: str, tp: int, eager: bool, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    llm = LLM(model, device=device, tensor_parallel_size=tp, max_num_seqs=args.concurrency,
              enforce_eager=eager, seed=0)
    load = time.perf_counter() - start
    try:
        prompts = [[100 + 37 * i + j for j in range(args.prompt_len)] for i in range(args.prompts)]
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(prompts, greedy)]

        def generate(batch: list[list[int]], n: int) -> list[int]:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            return [len(o.token_ids) for o in llm.generate(batch, params)]

        many = [[200 + 13 * i + j for j in range(args.prompt_len)]
                for i in range(args.concurrency)]
        generate(many[:2], 4)  # warm up
        speed = measure_batch1(generate, prompts[0], args.batch_1_tokens, 1)
        speed.update(measure_batch(generate, many, args.output_len))
    finally:
        llm.shutdown()
    name = f"{device} tp{tp}" + (" eager" if eager and device != "cpu" else "")
    return {"run": name, "load_s": round(load, 1),
            "batch1_decode_tok_s": speed.get("batch1_decode_tok_s"),
            "batch_output_tok_s": speed.get("batch_output_tok_s"), "tokens": tokens}


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, position) of the first token that differs, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return i, j
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--random-from", default=None,
                   help="a model directory whose config.json and tokenizer shape a random model")
    p.add_argument("--init-std", type=float, default=0.05)
    p.add_argument("--work-dir", default="/tmp/deepinfer-gpu-check")
    p.add_argument("--devices", default="cpu,cuda",
                   help="runs, compared with the first; cuda:tp2 is added with two GPUs")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-1-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args(argv)
    if args.random_from:
        model = str(random_llama(Path(args.random_from), Path(args.work_dir) / "random-llama",
                                 args.init_std))
    else:
        model = args.model or "default"
    plan = [(d, 1, False) for d in args.devices.split(",")]
    if "cuda" in args.devices:  # the same without CUDA graphs, and over two GPUs
        plan.append(("cuda", 1, True))
        if torch.cuda.device_count() >= 2:
            plan.append(("cuda", 2, False))
    results = []
    for device, tp, eager in plan:
        result = run(model, device, tp, eager, args)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
    base, failed = results[0], False
    for r in results[1:]:
        diff = first_difference(base["tokens"], r["tokens"])
        same = sum(x == y for x, y in zip(base["tokens"], r["tokens"]))
        where = ("identical" if diff is None
                 else f"first differs at prompt {diff[0]}, token {diff[1]}")
        print(f"greedy {r['run']} vs {base['run']}: "
              f"{same}/{len(base['tokens'])} prompts identical ({where})")
        failed |= diff is not None
    for r in results:
        print(f"speed {r['run']}: batch-1 "
              f"{r['batch1_decode_tok_s'] or 0:.1f} tok/s, {args.concurrency} concurrent "
              f"{r['batch_output_tok_s'] or 0:.1f} tok/s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
