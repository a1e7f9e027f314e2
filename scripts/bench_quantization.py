"""Quantized weights against float32 and llama.cpp, on the default model, in one run.

Formats (each through scripts/bench_peers.py in its own process, so nothing is shared):

* deepinfer fp32            - the float32 weights (dequantized once from the shipped Q4_1 GGUF)
* deepinfer int8            - the same, `--quantization int8` (per output channel, at load)
* deepinfer GGUF Q8_0       - `--model <Q8_0 GGUF>` served as it is
* deepinfer GGUF Q4_1       - `--model <the shipped Q4_1 GGUF>` served as it is
* llama.cpp F32, Q8_0, Q4_1 - llama.cpp's own `llama-server` on the F32 conversion and the same
                              two files (bench_peers' `llama-server` system; "n/a" without the
                              binary: `--llama-server PATH` or $LLAMA_SERVER, see
                              scripts/llama_server.py for how to build it)

For each: batch-1 decode tok/s and output tok/s with `--num-prompts` (64) concurrent requests
(bench_peers' definitions; llama-server batches them over `--llama-server-slots` (16) parallel
slots, the rest wait in its queue); memory (DeepInfer: the rank-0 worker's RSS after the run;
llama.cpp: the llama-server process's RSS).

The VM this runs on drifts by 10-20 % from minute to minute, so the formats run in `--rounds`
interleaved rounds and the table shows each one's median. It also reports the greedy text of
--agreement-prompts chat prompts under int8 against fp32 (and Q4_1 served against its float32
conversion): how many answers are identical, and the common prefix in characters
(`--agreement-tokens 0` skips it).

The F32 and Q8_0 GGUFs are made from the Q4_1 file's values (scripts/gguf_to_f32.py IN OUT
[Q8_0]) into `--work-dir`: the default model only ships as Q4_1.

    LLAMA_SERVER=/path/to/llama-server .venv/bin/python scripts/bench_quantization.py \
        --result-file quant.json

A smoke run with a tiny workload:

    .venv/bin/python scripts/bench_quantization.py --rounds 1 --num-prompts 4 --input-len 16 \
        --output-len 8 --batch-1-tokens 8 --agreement-tokens 0

`--kv-cache-dtype float16` keeps DeepInfer's KV cache in float16, as llama.cpp keeps its own
(default: float32, the model's dtype).

`--alternate` measures batch-1 decode only, with every format loaded at once and measured in
turn each round (one llama-server per llama.cpp format, each DeepInfer format its own engine
processes, all idle while another format runs): the VM's drift between processes falls on all
formats alike, where the default mode's separate processes run minutes apart.
`--kv-cache-dtype` then takes several values, each a DeepInfer row of its own:

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
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for scripts.*, after site-packages

from scripts import bench_peers, llama_server  # noqa: E402

PROMPTS = ["What is the capital of France? Answer briefly.", "Write a haiku about the sea.",
           "Explain photosynthesis in two sentences.", "List three prime numbers.",
           "Who wrote Hamlet?", "Give me a recipe for pancakes.", "What is 12 times 12?",
           "Describe a cat in one paragraph."]
AGREEMENT_PREFIX = "BENCH_QUANT_TEXTS "
# DeepInfer format against the llama.cpp format at the same precision.
PEER_PAIRS = (("deepinfer fp32", "llama.cpp F32"), ("deepinfer int8", "llama.cpp Q8_0"),
              ("deepinfer GGUF Q8_0", "llama.cpp Q8_0"), ("deepinfer GGUF Q4_1", "llama.cpp Q4_1"))


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
                   help="batch-1 decode only, every format loaded at once, measured in turn")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help=f"llama-server binary (default: ${llama_server.BINARY_ENV}, else PATH)")
    p.add_argument("--llama-server-slots", type=int, default=llama_server.DEFAULT_SLOTS,
                   help="llama-server's parallel slots, -np (default: %(default)s)")
    p.add_argument("--agreement-tokens", type=int, default=64,
                   help="tokens of each greedy answer compared (0: skip the comparison)")
    p.add_argument("--work-dir", default="/tmp/deepinfer-bench-quant",
                   help="where the F32 and Q8_0 GGUFs are written")
    p.add_argument("--result-file", default=None)
    p.add_argument("--texts", default=None, help=argparse.SUPPRESS)  # child: MODEL[,QUANT]
    return p.parse_args(argv)


def formats(ggufs: dict[str, Path]) -> list[tuple[str, str, list[str]]]:
    """(label, bench_peers system, its flags); `ggufs` by type: F32, Q8_0, Q4_1."""
    return [
        ("deepinfer fp32", "deepinfer", []),
        ("deepinfer int8", "deepinfer", ["--quantization", "int8"]),
        ("deepinfer GGUF Q8_0", "deepinfer", ["--model", str(ggufs["Q8_0"])]),
        ("deepinfer GGUF Q4_1", "deepinfer", ["--model", str(ggufs["Q4_1"])]),
        *((f"llama.cpp {kind}", "llama-server", ["--gguf", str(ggufs[kind])])
          for kind in ("F32", "Q8_0", "Q4_1")),
    ]


def make_ggufs(work_dir: str) -> dict[str, Path]:
    """The shipped Q4_1 GGUF and its F32 and Q8_0 conversions (made once into `work_dir`)."""
    from deepinfer.engine.model_store import prepared_gguf

    q4_1 = prepared_gguf("default")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ggufs = {"Q4_1": q4_1}
    for kind in ("F32", "Q8_0"):
        ggufs[kind] = work / q4_1.name.replace("Q4_1", kind)
        if not ggufs[kind].exists():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "gguf_to_f32.py"), str(q4_1),
                            str(ggufs[kind]), kind], check=True)
    return ggufs


def peer_args(args: argparse.Namespace, system: str, flags: list[str]) -> argparse.Namespace:
    server = ["--llama-server", args.llama_server] if args.llama_server else []
    return bench_peers.parse_args([
        "--systems", system, "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--batch-1-tokens", str(args.batch_1_tokens), "--threads", str(args.threads),
        "--repeats", "2", "--kv-cache-dtype", args.kv_cache_dtype[0],
        "--llama-server-slots", str(args.llama_server_slots), *server, *flags])


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


def peer_ratios(values: dict[str, float | None], suffix: str) -> dict[str, float | None]:
    """DeepInfer format / llama.cpp format for every PEER_PAIRS label found in `values`
    (a label may carry a suffix such as " (KV float16)")."""
    ratios = {}
    for ours, peer in PEER_PAIRS:
        for label in values:
            if label.startswith(ours) and peer in values:
                name = f"{label.removeprefix('deepinfer ')} / {peer}, {suffix}"
                ratios[name] = bench_peers.ratio(values[label], values[peer])
    return ratios


# ----------------------------------------------------------------------------- --alternate


def start_llama_server(args: argparse.Namespace, gguf: Path, stack: ExitStack
                       ) -> bench_peers.GenerateFn:
    """A llama-server on `gguf`, stopped when `stack` closes; its generate function."""
    spec = bench_peers.llama_server_spec(peer_args(args, "llama-server", ["--gguf", str(gguf)]))
    server = stack.enter_context(llama_server.LlamaServer(spec))
    server.wait_healthy()
    return llama_server.server_generate(server.base_url)


def start_engines(args: argparse.Namespace, flags: list[str], stack: ExitStack
                  ) -> dict[str, bench_peers.GenerateFn]:
    """One DeepInfer engine per --kv-cache-dtype, shut down when `stack` closes."""
    from deepinfer import LLM

    model = flags[1] if flags[:1] == ["--model"] else "default"
    quantization = flags[1] if flags[:1] == ["--quantization"] else None
    generators = {}
    for kv in args.kv_cache_dtype:
        engine = LLM(model, quantization=quantization, kv_cache_dtype=kv, max_num_seqs=4,
                     worker_threads=args.threads)
        stack.callback(engine.shutdown)
        suffix = "" if len(args.kv_cache_dtype) == 1 else f" (KV {kv})"
        generators[suffix] = bench_peers.deepinfer_generate(engine)
    return generators


def alternate_batch1(args: argparse.Namespace, ggufs: dict[str, Path]) -> dict:
    """--alternate: every format (and DeepInfer KV cache type) loaded at once, batch-1 decode
    measured in turn each round; per label, its tok/s per round."""
    prompt = bench_peers.make_prompts(1, args.input_len, bench_peers.vocab_size("default"),
                                      0)[0]
    generators: dict[str, bench_peers.GenerateFn] = {}
    runs: dict[str, list[float]] = {}
    with ExitStack() as stack:
        for label, system, flags in formats(ggufs):
            if system == "llama-server":
                try:
                    generators[label] = start_llama_server(args, Path(flags[1]), stack)
                except bench_peers.Unavailable as e:
                    print(f"{label}: n/a ({e})", flush=True)
                continue
            for suffix, generate in start_engines(args, flags, stack).items():
                generators[label + suffix] = generate
        for generate in generators.values():
            generate([prompt], 8)  # warm-up
        runs = {label: [] for label in generators}
        for round_ in range(args.rounds):
            for label, generate in generators.items():
                result = bench_peers.measure_batch1(generate, prompt, args.batch_1_tokens, 2)
                runs[label].append(result["batch1_decode_tok_s"])
            print(f"round {round_ + 1}: " + ", ".join(
                f"{label} {fmt(r[-1])}" for label, r in runs.items()), flush=True)
    return runs


def report_alternate(args: argparse.Namespace, command: str, runs: dict) -> int:
    medians = {label: median(values) for label, values in runs.items()}
    print(f"\n{'format':<36} {'b1 decode tok/s (median)':>24}  per round")
    for label, values in runs.items():
        print(f"{label:<36} {fmt(medians[label]):>24}  {[round(v, 1) for v in values]}")
    ratios = peer_ratios(medians, "batch-1")
    print()
    for name, value in ratios.items():
        print(f"{name}: {fmt(value, '.2f')}x")
    if args.result_file:
        report = {"command": command, "environment": bench_peers.environment(),
                  "batch1_decode_tok_s": runs, "medians": medians, "ratios": ratios}
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.result_file}")
    return 0


# ----------------------------------------------------------------------------- default mode


def run_rounds(args: argparse.Namespace, ggufs: dict[str, Path]) -> dict[str, list[dict]]:
    """Every format once a round, each in its own bench_peers child; per label, its results."""
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in formats(ggufs)}
    for round_ in range(args.rounds):
        for label, system, flags in formats(ggufs):
            result = bench_peers.run_child(system, peer_args(args, system, flags))
            runs[label].append(result)
            print(f"round {round_ + 1} {label}: {result.get('status')} "
                  f"b1 {fmt(result.get('batch1_decode_tok_s'))} "
                  f"batch {fmt(result.get('batch_output_tok_s'))}", flush=True)
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per label: the medians over its successful rounds."""
    rows = {}
    for label, results in runs.items():
        ok = [r for r in results if r.get("status") == "ok"]
        memory = [r.get("worker_rss_mb", r.get("process_rss_mb")) for r in ok]
        rows[label] = {"batch1_decode_tok_s": median([r.get("batch1_decode_tok_s") for r in ok]),
                       "batch_output_tok_s": median([r.get("batch_output_tok_s") for r in ok]),
                       "memory_mb": median(memory), "runs": results,
                       "status": "ok" if ok else (results[0].get("reason") if results else "")}
    return rows


def compute_ratios(rows: dict[str, dict], num_prompts: int) -> dict[str, float | None]:
    ok = {label: row for label, row in rows.items() if row["status"] == "ok"}
    batch1 = {label: row["batch1_decode_tok_s"] for label, row in ok.items()}
    batch = {label: row["batch_output_tok_s"] for label, row in ok.items()}
    concurrent = f"{num_prompts} concurrent"
    ratios = {**peer_ratios(batch1, "batch-1"), **peer_ratios(batch, concurrent)}
    ratios[f"int8 / fp32, {concurrent}"] = bench_peers.ratio(
        batch.get("deepinfer int8"), batch.get("deepinfer fp32"))
    return ratios


def print_rows(rows: dict[str, dict]) -> None:
    print(f"\n{'format':<22} {'b1 decode tok/s':>15} {'batch tok/s':>12} {'memory MiB':>11}")
    for label, row in rows.items():
        if row["status"] != "ok":
            print(f"{label:<22} {row['status']}")
            continue
        print(f"{label:<22} {fmt(row['batch1_decode_tok_s']):>15} "
              f"{fmt(row['batch_output_tok_s']):>12} {fmt(row['memory_mb'], '.0f'):>11}")


def greedy_agreement(args: argparse.Namespace, q4_1: Path) -> tuple[dict, dict]:
    """(agreement per comparison, the texts); both empty with --agreement-tokens 0."""
    if args.agreement_tokens <= 0:
        return {}, {}
    fp32 = texts("default", args.agreement_tokens)
    int8 = texts("default,int8", args.agreement_tokens)
    q4 = texts(str(q4_1), args.agreement_tokens)
    agree = {"int8 vs fp32": agreement(fp32, int8), "GGUF Q4_1 vs fp32": agreement(fp32, q4)}
    return agree, {"fp32": fp32, "int8": int8, "gguf_q4_1": q4}


def report_rounds(args: argparse.Namespace, command: str, ggufs: dict[str, Path],
                  runs: dict[str, list[dict]]) -> int:
    rows = summarize(runs)
    ratios = compute_ratios(rows, args.num_prompts)
    agree, answers = greedy_agreement(args, ggufs["Q4_1"])
    print_rows(rows)
    print()
    for name, value in ratios.items():
        print(f"{name}: {fmt(value, '.2f')}x")
    for name, a in agree.items():
        print(f"greedy {name}: {a['identical']}/{a['of']} identical, common prefix "
              f"{a['common_prefix_chars']} of {a['answer_chars']} chars")
    if args.result_file:
        report = {"command": command, "environment": bench_peers.environment(),
                  "ggufs": {k: str(v) for k, v in ggufs.items()}, "rows": rows,
                  "ratios": ratios, "agreement": agree, "texts": answers}
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.result_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.texts:
        return texts_child(args.texts, args.agreement_tokens)
    ggufs = make_ggufs(args.work_dir)
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    if args.alternate:
        return report_alternate(args, command, alternate_batch1(args, ggufs))
    return report_rounds(args, command, ggufs, run_rounds(args, ggufs))


if __name__ == "__main__":
    sys.exit(main())
