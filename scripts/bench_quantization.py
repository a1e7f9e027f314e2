"""Quantized weights against float32 and llama.cpp, on the default model, in one run.

Formats (each through scripts/bench_peers.py in its own process, so nothing is shared):

* deepinfer fp32       - the float32 weights (dequantized once from the shipped Q4_1 GGUF)
* deepinfer int8       - the same, `--quantization int8` (per output channel, at load)
* deepinfer GGUF Q8_0  - `--model <Q8_0 GGUF>` served as it is
* deepinfer GGUF Q4_1  - `--model <the shipped Q4_1 GGUF>` served as it is
* llama.cpp Q8_0, Q4_1 - llama-cpp-python on the same two files (skipped if not installed)

For each: batch-1 decode tok/s and, for DeepInfer, output tok/s with `--num-prompts`
(64) concurrent requests (bench_peers' definitions); worker memory (the rank-0 worker's RSS
after the run; llama.cpp: its whole process, interpreter included). llama-cpp-python decodes one
sequence at a time, so its batch row is its batch-1 rate.

The VM this runs on drifts by 10-20 % from minute to minute, so the formats run in `--rounds`
interleaved rounds and the table shows each one's median. It also reports the greedy text of
--agreement-prompts chat prompts under int8 against fp32 (and Q4_1 served against its float32
conversion): how many answers are identical, and the common prefix in characters.

The Q8_0 GGUF is made from the Q4_1 file's values (scripts/gguf_to_f32.py IN OUT Q8_0): the
default model only ships as Q4_1.

    .venv/bin/python scripts/bench_quantization.py --result-file quant.json

`--kv-cache-dtype float16` keeps DeepInfer's KV cache in float16, as llama.cpp keeps its own
(default: float32, the model's dtype).

`--alternate` measures batch-1 decode only, with every format loaded in this one process at
once and measured in turn each round (llama.cpp through llama-cpp-python in this process, each
DeepInfer format its own engine processes, idle while another format runs): the VM's drift
between processes falls on all formats alike, where the default mode's separate processes run
minutes apart. `--kv-cache-dtype` then takes several values, each a DeepInfer row of its own:

    .venv/bin/python scripts/bench_quantization.py --alternate --rounds 5 \
        --kv-cache-dtype auto float16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for scripts.*, after site-packages

from scripts import bench_peers  # noqa: E402

PROMPTS = ["What is the capital of France? Answer briefly.", "Write a haiku about the sea.",
           "Explain photosynthesis in two sentences.", "List three prime numbers.",
           "Who wrote Hamlet?", "Give me a recipe for pancakes.", "What is 12 times 12?",
           "Describe a cat in one paragraph."]
AGREEMENT_PREFIX = "BENCH_QUANT_TEXTS "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-1-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=bench_peers.default_threads())
    p.add_argument("--kv-cache-dtype", default=["auto"], nargs="+",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="DeepInfer's KV cache type in every row (llama.cpp's is float16); "
                        "several values with --alternate")
    p.add_argument("--alternate", action="store_true",
                   help="batch-1 decode only, every format in this process, in turn")
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--work-dir", default="/tmp/deepinfer-bench-quant",
                   help="where the Q8_0 GGUF is written")
    p.add_argument("--result-file", default=None)
    p.add_argument("--texts", default=None, help=argparse.SUPPRESS)  # child: MODEL[,QUANT]
    return p.parse_args(argv)


def formats(q4_1: Path, q8_0: Path) -> list[tuple[str, str, list[str]]]:
    """(label, bench_peers system, its flags)."""
    return [
        ("deepinfer fp32", "deepinfer", []),
        ("deepinfer int8", "deepinfer", ["--quantization", "int8"]),
        ("deepinfer GGUF Q8_0", "deepinfer", ["--model", str(q8_0)]),
        ("deepinfer GGUF Q4_1", "deepinfer", ["--model", str(q4_1)]),
        ("llama.cpp Q8_0", "llamacpp", ["--gguf", str(q8_0)]),
        ("llama.cpp Q4_1", "llamacpp", ["--gguf", str(q4_1)]),
    ]


def peer_args(args: argparse.Namespace, system: str, flags: list[str]) -> argparse.Namespace:
    return bench_peers.parse_args([
        "--systems", system, "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--batch-1-tokens", str(args.batch_1_tokens), "--threads", str(args.threads),
        "--repeats", "2", "--kv-cache-dtype", args.kv_cache_dtype[0], *flags])


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def texts_child(spec: str, tokens: int) -> int:
    """--texts MODEL[,QUANT]: greedy chat answers to PROMPTS, one per line of JSON."""
    from deepinfer import LLM, SamplingParams

    model, _, quantization = spec.partition(",")
    llm = LLM(model, quantization=quantization or None)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        texts = [llm.chat([{"role": "user", "content": p}], params).text for p in PROMPTS]
    finally:
        llm.shutdown()
    print(AGREEMENT_PREFIX + json.dumps(texts), flush=True)
    return 0


def texts(spec: str, tokens: int) -> list[str]:
    cmd = [sys.executable, __file__, "--texts", spec, "--agreement-tokens", str(tokens)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith(AGREEMENT_PREFIX))
    return json.loads(line[len(AGREEMENT_PREFIX):])


def agreement(a: list[str], b: list[str]) -> dict:
    prefixes = [len(os.path.commonprefix([x, y])) for x, y in zip(a, b)]
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "common_prefix_chars": prefixes, "answer_chars": [len(x) for x in a]}


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def alternate_batch1(args: argparse.Namespace, q4_1: Path, q8_0: Path) -> dict:
    """--alternate: every format (and DeepInfer KV cache type) loaded here at once, batch-1
    decode measured in turn each round; per label, its tok/s per round."""
    from deepinfer import LLM

    prompt = bench_peers.make_prompts(1, args.input_len, bench_peers.vocab_size("default"),
                                      0)[0]
    engines, generators = [], {}
    for label, system, flags in formats(q4_1, q8_0):
        if system == "llamacpp":
            from llama_cpp import Llama

            llm = Llama(model_path=flags[1], n_ctx=args.input_len + args.batch_1_tokens + 16,
                        n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
            generators[label] = bench_peers.llamacpp_generate(llm)
            continue
        model = flags[1] if flags[:1] == ["--model"] else "default"
        quantization = flags[1] if flags[:1] == ["--quantization"] else None
        for kv in args.kv_cache_dtype:
            engine = LLM(model, quantization=quantization, kv_cache_dtype=kv, max_num_seqs=4,
                         worker_threads=args.threads)
            engines.append(engine)
            name = label if len(args.kv_cache_dtype) == 1 else f"{label} (KV {kv})"
            generators[name] = bench_peers.deepinfer_generate(engine)
    runs: dict[str, list[float]] = {label: [] for label in generators}
    try:
        for generate in generators.values():
            generate([prompt], 8)  # warm-up
        for round_ in range(args.rounds):
            for label, generate in generators.items():
                result = bench_peers.measure_batch1(generate, prompt, args.batch_1_tokens, 2)
                runs[label].append(result["batch1_decode_tok_s"])
            print(f"round {round_ + 1}: " + ", ".join(
                f"{label} {fmt(r[-1])}" for label, r in runs.items()), flush=True)
    finally:
        for engine in engines:
            engine.shutdown()
    return runs


def report_alternate(args: argparse.Namespace, command: str, runs: dict) -> int:
    medians = {label: median(values) for label, values in runs.items()}
    print(f"\n{'format':<36} {'b1 decode tok/s (median)':>24}  per round")
    for label, values in runs.items():
        print(f"{label:<36} {fmt(medians[label]):>24}  {[round(v, 1) for v in values]}")
    ratios = {}
    for ours, peer in (("deepinfer int8", "llama.cpp Q8_0"),
                       ("deepinfer GGUF Q4_1", "llama.cpp Q4_1")):
        for label in medians:
            if label.startswith(ours):
                ratios[f"{label} / {peer}"] = bench_peers.ratio(medians[label], medians[peer])
    print()
    for name, value in ratios.items():
        print(f"{name}: {fmt(value, '.2f')}x")
    if args.result_file:
        report = {"command": command, "environment": bench_peers.environment(),
                  "batch1_decode_tok_s": runs, "medians": medians, "ratios": ratios}
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.result_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.texts:
        return texts_child(args.texts, args.agreement_tokens)
    from deepinfer.engine.model_store import prepared_gguf

    q4_1 = prepared_gguf("default")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    q8_0 = work / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not q8_0.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "gguf_to_f32.py"), str(q4_1),
                        str(q8_0), "Q8_0"], check=True)
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    if args.alternate:
        return report_alternate(args, command, alternate_batch1(args, q4_1, q8_0))
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in formats(q4_1, q8_0)}
    for round_ in range(args.rounds):
        for label, system, flags in formats(q4_1, q8_0):
            result = bench_peers.run_child(system, peer_args(args, system, flags))
            runs[label].append(result)
            print(f"round {round_ + 1} {label}: {result.get('status')} "
                  f"b1 {fmt(result.get('batch1_decode_tok_s'))} "
                  f"batch {fmt(result.get('batch_output_tok_s'))}", flush=True)
    rows = {}
    for label, results in runs.items():
        ok = [r for r in results if r.get("status") == "ok"]
        b1 = median([r.get("batch1_decode_tok_s") for r in ok])
        batch = median([r.get("batch_output_tok_s") for r in ok])
        memory = median([r.get("worker_rss_mb", r.get("process_rss_mb")) for r in ok])
        rows[label] = {"batch1_decode_tok_s": b1, "batch_output_tok_s": batch,
                       "memory_mb": memory, "runs": results,
                       "status": "ok" if ok else (results[0].get("reason") if results else "")}
    fp32 = texts("default", args.agreement_tokens)
    int8 = texts("default,int8", args.agreement_tokens)
    q4 = texts(str(q4_1), args.agreement_tokens)
    agree = {"int8 vs fp32": agreement(fp32, int8), "GGUF Q4_1 vs fp32": agreement(fp32, q4)}

    print(f"\n{'format':<22} {'b1 decode tok/s':>15} {'batch tok/s':>12} {'memory MiB':>11}")
    for label, row in rows.items():
        if row["status"] != "ok":
            print(f"{label:<22} {row['status']}")
            continue
        batch = row["batch_output_tok_s"] if label.startswith("deepinfer") else None
        print(f"{label:<22} {fmt(row['batch1_decode_tok_s']):>15} {fmt(batch):>12} "
              f"{fmt(row['memory_mb'], '.0f'):>11}")
    get = lambda label, key: rows.get(label, {}).get(key)  # noqa: E731
    ratios = {
        "int8 / llama.cpp Q8_0, batch-1": bench_peers.ratio(
            get("deepinfer int8", "batch1_decode_tok_s"),
            get("llama.cpp Q8_0", "batch1_decode_tok_s")),
        "GGUF Q4_1 / llama.cpp Q4_1, batch-1": bench_peers.ratio(
            get("deepinfer GGUF Q4_1", "batch1_decode_tok_s"),
            get("llama.cpp Q4_1", "batch1_decode_tok_s")),
        "int8 / fp32, 64 concurrent": bench_peers.ratio(
            get("deepinfer int8", "batch_output_tok_s"),
            get("deepinfer fp32", "batch_output_tok_s")),
    }
    print()
    for name, value in ratios.items():
        print(f"{name}: {fmt(value, '.2f')}x")
    for name, a in agree.items():
        print(f"greedy {name}: {a['identical']}/{a['of']} identical, common prefix "
              f"{a['common_prefix_chars']} of {a['answer_chars']} chars")
    if args.result_file:
        report = {"command": command, "environment": bench_peers.environment(),
                  "rows": rows, "ratios": ratios, "agreement": agree,
                  "texts": {"fp32": fp32, "int8": int8, "gguf_q4_1": q4}}
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
