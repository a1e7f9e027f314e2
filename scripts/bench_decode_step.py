"""One batch-1 decode step of the default model, DeepInfer's against llama.cpp's, in one process.

Whole-engine figures (scripts/bench_quantization.py) swing by 10-30 % on this VM from minute to
minute. This isolates the model step and takes the drift out: every format is loaded into the
same process, and each step alternates between them, so all see the same machine state.

* deepinfer int8 / GGUF Q8_0 / GGUF Q4_1: `ModelRunner.all_logits` of one decode token (the
  forward and the head's logits: what a worker computes per step, without sampling or IPC)
* llama.cpp Q8_0 / Q4_1: `Llama.eval` of one token (llama-cpp-python, the same GGUF files)

Each prints the median milliseconds of `--steps` steps after a 128-token prompt; ratios are
llama.cpp's time over ours (above 1: ours is faster).

    .venv/bin/python scripts/bench_decode_step.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

PROMPT = list(range(100, 228))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work-dir", default="/tmp/deepinfer-bench-quant",
                   help="where the Q8_0 GGUF is (made from the Q4_1 file when missing)")
    return p.parse_args(argv)


def runner(model: str, quantization: str | None, threads: int, python_layers: bool = False):
    """A batch-1 decode step after a 128-token prompt (`python_layers`: without the one-call
    decode layer)."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.protocol import (
        NewRequestInfo,
        SamplingParams,
        ScheduledSeq,
        StepPlan,
        pack_ids,
    )
    from deepinfer.workers.model_runner import ModelRunner

    cfg = EngineConfig(model=model, num_kv_blocks=64, block_size=16, quantization=quantization,
                       worker_threads=threads)
    r = ModelRunner(cfg)
    if python_layers:
        r.model.model.fast_layers = None
    table = np.arange(0, 32, dtype=np.int32).tobytes()
    first = ScheduledSeq("a", pack_ids(PROMPT), 0, [table], True)
    r.all_logits(StepPlan(0, [first], new_requests=[
        NewRequestInfo("a", pack_ids(PROMPT), SamplingParams(max_tokens=1000))]))

    def step(i: int, pos: int) -> None:
        r.all_logits(StepPlan(i, [ScheduledSeq("a", pack_ids([300 + i % 100]), pos, [table],
                                               True)]))
    return step


def llama(path: str, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    llm.eval(PROMPT)
    return lambda i, pos: llm.eval([300 + i % 100])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from deepinfer.engine.model_store import prepare_gguf_model, prepared_gguf

    torch.set_num_threads(args.threads)
    q4_1 = prepared_gguf("default")
    q8_0 = Path(args.work_dir) / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if not q8_0.exists():
        q8_0.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "gguf_to_f32.py"), str(q4_1),
                        str(q8_0), "Q8_0"], check=True)
    steps = {
        "deepinfer int8": runner("default", "int8", args.threads),
        "deepinfer GGUF Q8_0": runner(str(prepare_gguf_model(q8_0)), None, args.threads),
        "deepinfer GGUF Q4_1": runner(str(prepare_gguf_model(q4_1)), None, args.threads),
        "llama.cpp Q8_0": llama(str(q8_0), args.threads),
        "llama.cpp Q4_1": llama(str(q4_1), args.threads),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.inference_mode():
        for i in range(args.steps):
            for name, step in steps.items():
                start = time.perf_counter()
                step(i, len(PROMPT) + i)
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, value in ms.items():
        print(f"{name:<22} {value:6.2f} ms a step (median of {args.steps})")
    print(f"llama.cpp Q8_0 / deepinfer int8: {ms['llama.cpp Q8_0'] / ms['deepinfer int8']:.2f}x")
    print(f"llama.cpp Q8_0 / deepinfer GGUF Q8_0: "
          f"{ms['llama.cpp Q8_0'] / ms['deepinfer GGUF Q8_0']:.2f}x")
    print(f"llama.cpp Q4_1 / deepinfer GGUF Q4_1: "
          f"{ms['llama.cpp Q4_1'] / ms['deepinfer GGUF Q4_1']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
