"""Multi-LoRA serving benchmark: requests spread over 8 adapters against the base model alone.

What it measures, on one machine in one run (the default model unless --model), one server at a
time (never two at once):

* base-alone   - `deepinfer serve` without LoRA; every request names the base model.
* adapters     - the same flags plus `--enable-lora --max-lora-rank R --max-loras N
                 --lora-modules a0=PATH ... --allow-runtime-lora-updating`; request i names
                 adapter a{i % N}, so every batch mixes all N adapters.
* base-on-lora - on that same server, every request names the base model: what serving adapters
                 costs the requests that use none.

The adapters: --num-adapters PEFT LoRA adapters of rank --rank (lora_alpha 2 x rank) on the
model's HF checkpoint, targeting q/k/v/o and gate/up/down, A as PEFT initialises it and B drawn
from N(0, 0.02) (never zero: the products are real), a seed each; saved with `save_pretrained`
in a temporary directory (adapter_config.json + adapter_model.safetensors).

The workload: --num-prompts streamed /v1/completions requests sent all at once (concurrency =
--num-prompts), each of --input-len random words (frontend/bench/datasets.py, about one token a
word) and exactly --output-len tokens (ignore_eos, temperature 0); timed by the project's load
generator (frontend/bench/client.py `payload` / `send`, metrics.py `summarize`). Per
configuration: one warm-up run (--warmup-output-len tokens each; base-on-lora needs none, its
server is warm), then --rounds measured runs. Run r draws its prompts from --seed + r: the
configurations see the same prompts, and no run is served from an earlier run's prefix cache
(which keeps adapters and the base model apart). The round with the highest output tok/s is
reported; the JSON keeps them all. Ratios: adapters / base-alone for output tok/s (the target is
>= 0.7x) and for TTFT p99 (lower is better), and the same for base-on-lora.

Adapter load time (on the LoRA server, after its runs): a further adapter made the same way is
loaded with POST /v1/load_lora_adapter {"lora_name": "extra", "lora_path": PATH}, timed at the
client (200 expected); one request names "extra" (must succeed); then POST
/v1/unload_lora_adapter {"lora_name": "extra"}. The server's own histogram
`deepinfer_lora_load_seconds` (sum and count, from /metrics) is reported where it has one. A
server without the endpoints (404, or no --allow-runtime-lora-updating flag) reports "not
available" and the rest of the benchmark stands.

    .venv/bin/python scripts/bench_lora.py --result-file lora.json    # the full run, ~5 min
    .venv/bin/python scripts/bench_lora.py --quick                    # 16 requests, 32 tokens

Both servers get `--served-model-name base --max-model-len M --max-num-seqs N` (N =
--num-prompts: one batch holds every request) and --serve-args (e.g. "--worker-threads 2").
It prints a table, the ratios and the exact command line; --result-file writes it all as JSON
(every round, the adapters' and the load's details); the exit code is 1 if a request failed or
came back with another length, or a load that the server offers failed. "other cores" is how
many cores processes other than this script and its server used on average during a round
(from /proc); above 0.25 the figures are flagged: on 2 cores one busy core slows a server
several-fold. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for scripts.*, after site-packages

from deepinfer.frontend.bench.client import RequestResult, payload, send  # noqa: E402
from deepinfer.frontend.bench.datasets import random_requests  # noqa: E402
from deepinfer.frontend.bench.metrics import summarize  # noqa: E402
from scripts.bench_peers import OTHER_LOAD_WARNING, host_busy_s  # noqa: E402
from scripts.server_process import ServerProcess, descendants  # noqa: E402

ENDPOINT = "/v1/completions"
BASE_NAME = "base"
EXTRA_NAME = "extra"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.02
CONFIGS = ("base_alone", "adapters", "base_on_lora")
TARGET_RATIO = 0.7
LOAD_METRIC = "deepinfer_lora_load_seconds"
RUNTIME_FLAG = "--allow-runtime-lora-updating"
WARMUP_SEED_OFFSET = 10_000
# The workload by default and with --quick; a flag given explicitly wins over both.
FULL = {"num_prompts": 64, "output_len": 128, "rounds": 2}
QUICK = {"num_prompts": 16, "output_len": 32, "rounds": 1}


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="DeepInfer model name or an HF directory (default: SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per run, all sent at once (default {FULL['num_prompts']})")
    p.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"tokens generated per request (default {FULL['output_len']})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"measured runs per configuration (default {FULL['rounds']})")
    p.add_argument("--warmup-output-len", type=int, default=16,
                   help="tokens per request of each server's warm-up run")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--serve-args", default="", help="more `deepinfer serve` flags for both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help=f"a short check: {QUICK['num_prompts']} requests, "
                        f"{QUICK['output_len']} tokens, {QUICK['rounds']} round")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for a server to start")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.num_prompts, args.input_len, args.output_len, args.rounds, args.num_adapters,
           args.rank, args.warmup_output_len) < 1:
        p.error("--num-prompts, --input-len, --output-len, --rounds, --num-adapters, --rank "
                "and --warmup-output-len must be >= 1")
    if args.input_len + args.output_len >= args.max_model_len:
        p.error("--max-model-len must exceed --input-len + --output-len")
    return args


def adapter_names(n: int) -> list[str]:
    return [f"a{i}" for i in range(n)]


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The flags both servers share."""
    return ["--served-model-name", BASE_NAME, "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.num_prompts), *shlex.split(args.serve_args)]


def lora_flags(adapters: dict[str, Path], rank: int) -> list[str]:
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(adapters)),
            "--lora-modules", *[f"{name}={path}" for name, path in adapters.items()],
            RUNTIME_FLAG]


# ----------------------------------------------------------------------------- adapters


def model_dir(model: str) -> Path:
    """The model's HF directory (a named model is prepared first if it is not yet)."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model_store import ensure_model

    return Path(EngineConfig(model=ensure_model(model)).resolved_model_dir())


def make_adapters(base: Path, out: Path, names: list[str], rank: int,
                  seed: int) -> dict[str, Path]:
    """One PEFT LoRA adapter of `base` per name, in out/NAME: rank `rank`, lora_alpha 2 x rank,
    A as PEFT draws it, B ~ N(0, B_STD); adapter i's weights come from seed + i."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                             lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, config)
    weights = [(n, p) for n, p in peft_model.named_parameters()
               if ".lora_A." in n or ".lora_B." in n]
    paths = {}
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        with torch.no_grad():  # one adapter object, new weights for each saved copy
            for param_name, param in weights:
                if ".lora_A." in param_name:  # as PEFT (and nn.Linear) draw it
                    torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))
                else:
                    torch.nn.init.normal_(param, std=B_STD)
        paths[name] = out / name
        peft_model.save_pretrained(paths[name])
    return paths


# ----------------------------------------------------------------------------- workload


def request_bodies(num: int, input_len: int, output_len: int, models: list[str],
                   seed: int) -> list[dict[str, Any]]:
    """`num` streamed completion requests (random words, exactly `output_len` tokens each,
    greedy); request i names models[i % len(models)]."""
    reqs = random_requests(num, input_len, output_len, 0.0, seed)
    return [payload(ENDPOINT, models[i % len(models)], req, 0.0, ignore_eos=True)
            for i, req in enumerate(reqs)]


async def send_all(base_url: str, bodies: list[dict[str, Any]]
                   ) -> tuple[list[RequestResult], float]:
    """All requests at once; their results and the wall time from the first send to the last
    answer."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=connector) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(session, base_url + ENDPOINT, b) for b in bodies))
        return list(results), time.perf_counter() - start


def summary(results: list[RequestResult], duration: float, output_len: int) -> dict[str, Any]:
    """One run's figures: output tok/s, TTFT and ITL p50/p99 (ms), failures."""
    s = summarize(results, duration, {})
    short = sum(1 for r in results if r.ok and r.output_tokens != output_len)
    return {"output_tok_s": s["output_throughput"], "duration_s": duration,
            "ttft_p50_ms": s["median_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],
            "itl_p50_ms": s["median_itl_ms"], "itl_p99_ms": s["p99_itl_ms"],
            "prompt_tokens_mean": s["total_input_tokens"] / s["completed"] if s["completed"]
            else 0.0,
            "completed": s["completed"], "failed": s["failed"], "wrong_length": short,
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


def cpu_seconds(server_pid: int) -> tuple[float | None, float]:
    """(CPU seconds this host has used since boot, those of this process and of the server's
    process tree), from /proc."""
    ours = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    for pid in [server_pid, *descendants(server_pid)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ours += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return host_busy_s(), ours


def other_cores(before: tuple[float | None, float], after: tuple[float | None, float],
                wall: float) -> float | None:
    """Cores that processes other than this benchmark and its server used on average."""
    if before[0] is None or after[0] is None or wall <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


def timed_run(server: ServerProcess, bodies: list[dict[str, Any]],
              output_len: int) -> dict[str, Any]:
    before = cpu_seconds(server.proc.pid)
    start = time.perf_counter()
    results, duration = asyncio.run(send_all(server.base_url, bodies))
    wall = time.perf_counter() - start
    row = summary(results, duration, output_len)
    row["other_cores"] = other_cores(before, cpu_seconds(server.proc.pid), wall)
    return row


def measure(server: ServerProcess, models: list[str], args: argparse.Namespace,
            warmup: bool) -> dict[str, Any]:
    """An optional warm-up run, then --rounds runs; the best round (highest output tok/s)."""
    out: dict[str, Any] = {"models": sorted(set(models))}
    if warmup:
        bodies = request_bodies(args.num_prompts, args.input_len, args.warmup_output_len,
                                models, args.seed + WARMUP_SEED_OFFSET)
        out["warmup"] = timed_run(server, bodies, args.warmup_output_len)
        if out["warmup"]["failed"]:
            raise RuntimeError(f"warm-up requests failed: {out['warmup']['errors']}")
    rounds = []
    for r in range(args.rounds):
        bodies = request_bodies(args.num_prompts, args.input_len, args.output_len, models,
                                args.seed + r)
        rounds.append(timed_run(server, bodies, args.output_len))
        print(f"  round {r + 1}: {one_line(rounds[-1])}", flush=True)
    out["rounds"] = rounds
    out["best"] = best_round(rounds)
    return out


def best_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rounds, key=lambda r: r["output_tok_s"])


def one_line(row: dict[str, Any]) -> str:
    text = (f"{row['output_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 "
            f"{row['ttft_p99_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms p99 "
            f"{row['itl_p99_ms']:.1f} ms")
    if row["failed"] or row["wrong_length"]:
        text += f" ({row['failed']} failed, {row['wrong_length']} of the wrong length)"
    if row.get("other_cores") is not None:
        text += f"; other processes {row['other_cores']:.2f} cores"
    return text


# ----------------------------------------------------------------------------- adapter load


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, str]:
    """POST `body` as JSON: (HTTP status, response text); any status, never an HTTPError."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def histogram_totals(text: str, name: str) -> dict[str, float] | None:
    """{"sum", "count"} of the Prometheus histogram `name` (over all its labels) in a /metrics
    text, None if it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"sum": 0.0, "count": 0.0}
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            for key in totals:
                if sample.name == f"{name}_{key}":
                    totals[key] += sample.value
                    found = True
    return totals if found else None


def load_histogram(base_url: str) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
            return histogram_totals(resp.read().decode(), LOAD_METRIC)
    except (OSError, ValueError):
        return None


def complete(base_url: str, model: str) -> tuple[int, float, str]:
    """One short greedy completion naming `model`: (HTTP status, seconds, response text);
    a status of 200 with fewer than 8 tokens comes back as 500."""
    t0 = time.perf_counter()
    status, text = post_json(f"{base_url}{ENDPOINT}", {
        "model": model, "prompt": "The history of the city", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True})
    seconds = time.perf_counter() - t0
    if status == 200 and json.loads(text)["usage"]["completion_tokens"] != 8:
        status = 500
    return status, seconds, text


def adapter_load(base_url: str, path: Path, reference: str) -> dict[str, Any]:
    """Load adapter `path` as EXTRA_NAME at run time (timed at the client), ask it for one
    short completion (beside the same request to the loaded adapter `reference`), unload it;
    the server's load histogram before (the adapters loaded at start) and after."""
    before = load_histogram(base_url)
    t0 = time.perf_counter()
    status, text = post_json(f"{base_url}/v1/load_lora_adapter",
                             {"lora_name": EXTRA_NAME, "lora_path": str(path)})
    seconds = time.perf_counter() - t0
    if status == 404:
        return {"available": False, "note": f"POST /v1/load_lora_adapter: 404 {text[:200]}"}
    out: dict[str, Any] = {"available": True, "load_status": status, "load_s": seconds}
    if status != 200:
        out["error"] = f"load: HTTP {status}: {text[:300]}"
        return out
    out["reference_request_s"] = complete(base_url, reference)[1]
    status, out["first_request_s"], text = complete(base_url, EXTRA_NAME)
    out["request_status"] = status
    if status != 200:
        out["error"] = f"request to {EXTRA_NAME!r}: HTTP {status}: {text[:300]}"
    status, text = post_json(f"{base_url}/v1/unload_lora_adapter", {"lora_name": EXTRA_NAME})
    out["unload_status"] = status
    if status != 200:
        out.setdefault("error", f"unload: HTTP {status}: {text[:300]}")
    out["server_histogram_before"] = before
    out["server_histogram"] = after = load_histogram(base_url)
    if after is not None:
        prev = before or {"sum": 0.0, "count": 0.0}
        out["server_load_s"] = {"sum": after["sum"] - prev["sum"],
                                "count": after["count"] - prev["count"]}
    return out


# ----------------------------------------------------------------------------- report


def ratios(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each LoRA-server configuration's best round over base-alone's: output tok/s (higher is
    better) and TTFT / ITL p99 (lower is better)."""
    base = configs["base_alone"]["best"]
    out = {}
    for name in ("adapters", "base_on_lora"):
        if name not in configs:
            continue
        row = configs[name]["best"]
        out[name] = {key: row[key] / base[key] if base[key] else None
                     for key in ("output_tok_s", "ttft_p99_ms", "itl_p99_ms")}
    return out


def load_line(load: dict[str, Any]) -> str:
    if not load.get("available"):
        return f"adapter load: not available ({load.get('note', '')})"
    text = f"adapter load: {load['load_s']:.3f} s at the client"
    if "first_request_s" in load:
        text += (f"; its first 8-token request {load['first_request_s']:.3f} s (the same "
                 f"request to a loaded adapter {load['reference_request_s']:.3f} s)")
    server = load.get("server_load_s")
    if server and server["count"]:
        text += f"; server {LOAD_METRIC}: {server['sum']:.3f} s over {server['count']:.0f} load(s)"
    elif "server_histogram" in load:
        text += f"; no {LOAD_METRIC} on /metrics"
    if load.get("error"):
        text += f"; ERROR {load['error']}"
    return text


def table(result: dict[str, Any]) -> str:
    rows = ["| configuration | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) "
            "| ITL p99 (ms) | failed | other cores |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in CONFIGS:
        if name in result["configs"]:
            r = result["configs"][name]["best"]
            other = "-" if r.get("other_cores") is None else f"{r['other_cores']:.2f}"
            rows.append(f"| {name} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} "
                        f"| {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} "
                        f"| {r['itl_p99_ms']:.1f} | {r['failed']} | {other} |")
    rows.append("")
    for name, ratio in result["ratios"].items():
        tok, ttft = ratio["output_tok_s"], ratio["ttft_p99_ms"]
        line = (f"{name} / base_alone: output tok/s {tok:.2f}x, TTFT p99 {ttft:.2f}x, "
                f"ITL p99 {ratio['itl_p99_ms']:.2f}x")
        if name == "adapters":
            verdict = "met" if tok >= TARGET_RATIO else "NOT met"
            line += f" (target tok/s >= {TARGET_RATIO}x: {verdict})"
        rows.append(line)
    if "adapter_load" in result:
        rows.append(load_line(result["adapter_load"]))
    busy = max((r.get("other_cores") or 0.0 for c in result["configs"].values()
                for r in c["rounds"]), default=0.0)
    if busy > OTHER_LOAD_WARNING:
        rows.append(f"WARNING: other processes used up to {busy:.2f} cores during a run: on a "
                    "small machine these figures are not to be trusted (run on an idle one)")
    return "\n".join(rows)


def failures(result: dict[str, Any]) -> list[str]:
    out = []
    for name, config in result["configs"].items():
        for r in config["rounds"]:
            if r["failed"] or r["wrong_length"]:
                out.append(f"{name}: {r['failed']} failed, {r['wrong_length']} of the wrong "
                           f"length {r['errors']}")
    if result.get("adapter_load", {}).get("error"):
        out.append(result["adapter_load"]["error"])
    return out


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    result: dict[str, Any] = {"command": command, "settings": {
        k: v for k, v in vars(args).items() if k not in ("result_file",)}, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        t0 = time.perf_counter()
        names = adapter_names(args.num_adapters)
        made = make_adapters(model_dir(args.model), Path(tmp), [*names, EXTRA_NAME], args.rank,
                             args.seed)
        result["adapter_creation_s"] = time.perf_counter() - t0
        adapters = {name: made[name] for name in names}
        print(f"{len(made)} rank-{args.rank} adapters made in "
              f"{result['adapter_creation_s']:.1f} s", flush=True)

        print("base_alone:", flush=True)
        server = ServerProcess(args.model, *serve_flags(args), timeout=args.timeout)
        try:
            result["configs"]["base_alone"] = measure(server, [BASE_NAME], args, True)
        finally:
            server.stop()

        server = ServerProcess(args.model, *serve_flags(args),
                               *lora_flags(adapters, args.rank),
                               timeout=args.timeout)
        try:
            print("adapters:", flush=True)
            result["configs"]["adapters"] = measure(server, names, args, True)
            print("base_on_lora:", flush=True)
            result["configs"]["base_on_lora"] = measure(server, [BASE_NAME], args, False)
            result["adapter_load"] = adapter_load(server.base_url, made[EXTRA_NAME], names[0])
        finally:
            server.stop()
    result["ratios"] = ratios(result["configs"])
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    result = run(args, shlex.join([sys.executable, sys.argv[0], *argv]))
    print()
    print(table(result))
    print(f"\n{result['command']}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
        print(f"results written to {args.result_file}")
    problems = failures(result)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
