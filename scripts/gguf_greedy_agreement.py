"""Greedy tokens of a GGUF model, DeepInfer's and llama-server's, against HF transformers on the
same weights dequantized (float32): how many leading tokens agree, per prompt.

    .venv/bin/python scripts/gguf_greedy_agreement.py /tmp/models/1b/Q4_K_M.gguf \\
        [--prompts 4] [--prompt-len 32] [--tokens 16] [--llama-server PATH]

Both engines round activations where the reference does not (DeepInfer: int8 into the
quantized linears, per 256 for K-quants, per 32 for Q8_0; llama.cpp: its Q8 activations,
float16 KV), so a random model's
near-tied logits part ways sooner or later; the report is how far each follows the reference.
Prompts are random token ids (fixed seed). llama-server is skipped when not found (`--llama-
server`, $LLAMA_SERVER; scripts/llama_server.py builds it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402  (a sibling script)


def hf_greedy(gguf_path: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepinfer.engine.model_store import ensure_model
    from deepinfer.engine.model_store.gguf_weights import hf_tensors

    model_dir = ensure_model(gguf_path)  # the sidecar: config.json and the tokenizer
    config = AutoConfig.from_pretrained(model_dir)
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reader = GGUFReader(gguf_path)
    state = {name: torch.from_numpy(w) for name, w in hf_tensors(
        reader, reader.fields["general.architecture"].contents(), config.num_attention_heads,
        config.num_key_value_heads)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                                 min_new_tokens=tokens, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def deepinfer_greedy(gguf_path: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(gguf_path)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def llama_greedy(binary: str, gguf_path: str, prompts: list[list[int]], tokens: int,
                 threads: int) -> list[list[int]]:
    spec = llama_server.ServerSpec(binary, gguf_path, 1,
                                   llama_server.context_size(1, max(map(len, prompts)) + tokens),
                                   threads)
    out = []
    with llama_server.LlamaServer(spec) as server:
        server.wait_healthy()
        for prompt in prompts:
            body = dict(llama_server.completion_body(prompt, tokens), return_tokens=True)
            req = urllib.request.Request(server.base_url + "/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                out.append(json.loads(resp.read())["tokens"])
    return out


def agreement(ours: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens are the reference's."""
    counts = []
    for a, b in zip(ours, reference):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        counts.append(n)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    from deepinfer.engine.model_store import ensure_model

    config = json.loads((Path(ensure_model(args.gguf)) / "config.json").read_text())
    vocab = config["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    torch.set_num_threads(args.threads)
    reference = hf_greedy(args.gguf, prompts, args.tokens)
    results = {"deepinfer": agreement(deepinfer_greedy(args.gguf, prompts, args.tokens),
                                      reference)}
    binary = llama_server.find_binary(args.llama_server)
    if binary:
        results["llama-server"] = agreement(
            llama_greedy(binary, args.gguf, prompts, args.tokens, args.threads), reference)
    print(f"{args.gguf}: leading greedy tokens equal to HF transformers on the dequantized "
          f"weights, of {args.tokens}, per prompt ({args.prompts} random prompts of "
          f"{args.prompt_len} tokens)")
    for system, counts in results.items():
        print(f"  {system:>12}: {counts} (mean {sum(counts) / len(counts):.1f})")


if __name__ == "__main__":
    main()
