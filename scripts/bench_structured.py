"""Structured output benchmark: what a JSON schema costs, and how long grammars take to compile.

* throughput - `--concurrency` requests submitted at once to DeepInfer's offline `engine.LLM`
  (the same processes as the server, without HTTP), each constrained by one JSON schema (eight
  products with bounded fields: every answer is about the same length), greedy, stopping where
  the grammar ends. Then the same prompts unconstrained, each for exactly as many tokens as its
  constrained answer had (EOS ignored), so both sides generate the same token counts. Output
  tok/s = all output tokens / wall time; the sides alternate `--repeats` times and the best of
  each is kept. Target: constrained >= 0.90x unconstrained.
* compile - the xgrammar backend for the model, in this process: milliseconds to compile each
  of the tests' JSON schemas (scripts/structured_schemas.py) the first time, and to get it
  again from the compile service's cache.

    .venv/bin/python scripts/bench_structured.py                     # the full run
    .venv/bin/python scripts/bench_structured.py --concurrency 2 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # for scripts.*, after site-packages

from deepinfer.engine.protocol import GrammarSpec, SamplingParams  # noqa: E402
from deepinfer.engine.runtime.llm import LLM  # noqa: E402

PRODUCT = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 100, "maximum": 999},
    "name": {"type": "string", "minLength": 3, "maxLength": 16},
    "price": {"type": "number", "minimum": 0, "maximum": 1000},
    "in_stock": {"type": "boolean"}},
    "required": ["id", "name", "price", "in_stock"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"products": {
    "type": "array", "minItems": 8, "maxItems": 8, "items": PRODUCT}},
    "required": ["products"], "additionalProperties": False}
TOPICS = ["a hardware store", "a bakery", "a bookshop", "a toy shop", "a garden centre",
          "a music store", "a pharmacy", "a bike shop"]


def prompts(n: int) -> list[str]:
    return [f"The catalogue of {TOPICS[i % len(TOPICS)]} (shop {i}), as JSON: " for i in range(n)]


def throughput(args: argparse.Namespace) -> dict:
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    texts = prompts(args.concurrency)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, grammar=grammar)
    best = {"schema": 0.0, "free": 0.0}
    with LLM(args.model, max_num_seqs=max(64, args.concurrency)) as llm:
        llm.generate(texts[:2], constrained)  # warm-up: the backend loads, the schema compiles
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(texts, constrained)
            wall = time.perf_counter() - t0
            lengths = [len(o.token_ids) for o in outs]
            assert all(o.finish_reason == "stop" for o in outs), "raise --max-tokens"
            for o in outs:
                json.loads(o.text)
            best["schema"] = max(best["schema"], sum(lengths) / wall)
            free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                    for n in lengths]
            t0 = time.perf_counter()
            outs = llm.generate(texts, free)
            wall = time.perf_counter() - t0
            assert [len(o.token_ids) for o in outs] == lengths
            best["free"] = max(best["free"], sum(lengths) / wall)
    return {"concurrency": args.concurrency, "mean_output_tokens": statistics.mean(lengths),
            "schema_tok_s": best["schema"], "free_tok_s": best["free"],
            "ratio": best["schema"] / best["free"]}


def compile_times(args: argparse.Namespace) -> dict:
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model_store import ensure_model
    from deepinfer.workers.structured.compile_service import GrammarCompileService
    from deepinfer.workers.structured.xgrammar_backend import XGrammarBackend
    from scripts.structured_schemas import SCHEMAS

    config = EngineConfig(model=ensure_model(args.model))
    info = config.model_config()
    t0 = time.perf_counter()
    backend = XGrammarBackend.for_model(config.resolved_model_dir(), info.vocab_size,
                                        list(info.eos_token_ids))
    setup = time.perf_counter() - t0
    service = GrammarCompileService(lambda: backend, timeout_s=60)

    def timed(rid: str, spec: GrammarSpec) -> float:
        done = threading.Event()
        t0 = time.perf_counter()
        service.submit(rid, spec, lambda *_: done.set())
        done.wait()
        service.take(rid, spec)
        return (time.perf_counter() - t0) * 1e3

    first, cached = [], []
    for i, (_, schema) in enumerate(SCHEMAS):
        spec = GrammarSpec("json_schema", json.dumps(schema))
        first.append(timed(f"a{i}", spec))
        cached.append(timed(f"b{i}", spec))
    service.close()
    return {"backend_setup_ms": setup * 1e3, "schemas": len(SCHEMAS),
            "first_ms_median": statistics.median(first), "first_ms_max": max(first),
            "cached_ms_median": statistics.median(cached), "cached_ms_max": max(cached)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    result = {"command": " ".join(["scripts/bench_structured.py", *(argv or sys.argv[1:])]),
              "compile": compile_times(args), "throughput": throughput(args)}
    c, t = result["compile"], result["throughput"]
    print(f"compile: backend setup {c['backend_setup_ms']:.0f} ms; {c['schemas']} schemas, "
          f"first compile median {c['first_ms_median']:.1f} ms (max {c['first_ms_max']:.1f}), "
          f"cached median {c['cached_ms_median']:.3f} ms (max {c['cached_ms_max']:.3f})")
    print(f"throughput at {t['concurrency']} concurrent, {t['mean_output_tokens']:.0f} tokens "
          f"each: schema {t['schema_tok_s']:.1f} tok/s, unconstrained {t['free_tok_s']:.1f} "
          f"tok/s, ratio {t['ratio']:.3f} (target >= 0.90)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
