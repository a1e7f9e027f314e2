"""DeepSeek-V4 speculative decoding on a tiny V4: its own MTP layer and DSpark against no
speculation and n-gram lookup (issue 55).

The tiny V4 (scripts/tiny_models.py, random) gets an MTP block trained for `--train-steps`
steps on the model's own greedy continuations of random prompts (teacher forcing: the block at
position i reads the target's residual streams h_i and token t_{i+1} and learns t_{i+2}), so that
it agrees with the target often, as a real checkpoint's does (the figures are taken on those
prompts, the first `--train-seqs` of them the training set: a memorized tiny model, so the
acceptance says what the engine makes of an MTP layer that agrees, not how well one trains).
The DSpark drafter (scripts/tiny_models.py add_dspark_weights) is trained the same way
(`--dspark-steps` blocks anchored at random positions of those sequences: cross-entropy on its
drafts, binary cross-entropy of its confidence head on whether each draft is the target's
token), then runs once with every draft slot verified (threshold 0) and once with its
confidence head choosing the length (`--threshold`).

For each method, greedy, one process after another in this one (the engine's own processes
each time): batch 1 over `--num-prompts` prompts and `--concurrency` prompts at once, each
`--output-len` tokens (EOS ignored). Figures: output tok/s (all output tokens over the wall
time), acceptance length (tokens per verification: accepted drafts / verify steps + 1), the
drafts' acceptance rate; the greedy text is compared with no speculation (a difference is a
FAIL line and exit code 1). Usage:

    .venv/bin/python scripts/bench_spec_v4.py --result-file spec_v4.json          # full run
    .venv/bin/python scripts/bench_spec_v4.py --train-steps 5 --num-prompts 1 \\
        --output-len 8 --concurrency 2                                          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # for scripts.*, after site-packages

from scripts.tiny_models import add_dspark_weights, add_mtp_weights, save_tiny_model  # noqa: E402

METHODS = ("none", "ngram", "mtp", "dspark-fixed", "dspark-confidence")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workdir", default=None, help="where the tiny models go (default: a temp dir)")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--train-seqs", type=int, default=16, help="greedy sequences to train on")
    p.add_argument("--lr", type=float, default=1e-2, help="MTP training's Adam learning rate")
    p.add_argument("--dspark-steps", type=int, default=2000,
                   help="DSpark drafter training steps (one block each; 0: a random drafter)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--threshold", type=float, default=0.5, help="DSpark's confidence threshold")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- MTP training


def greedy_sequences(model_dir: Path, count: int, prompt_len: int, out_len: int,
                     seed: int) -> list[list[int]]:
    """The target's own greedy continuations of random prompts (prompt + output ids)."""
    import numpy as np

    from deepinfer import LLM, SamplingParams

    rng = np.random.default_rng(seed + 1000)
    prompts = [rng.integers(3, 40000, size=prompt_len).tolist() for _ in range(count)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), num_kv_blocks=2048, block_size=16) as llm:
        return [p + o.token_ids for p, o in zip(prompts, llm.generate(prompts, params))]


def train_mtp(model_dir: Path, sequences: list[list[int]], steps: int, seed: int,
              lr: float = 1e-2) -> float:
    """Train the MTP block (model-mtp.safetensors, DeepSeek's names) with transformers' V4
    layers: the block is the extra layer of a model one layer deeper whose first layers (the
    target's) stay frozen. Returns the last loss."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    raw = json.loads((model_dir / "config.json").read_text())
    n = raw["num_hidden_layers"]
    own_names = ("e_proj", "h_proj", "enorm", "hnorm", "norm.", "hc_head")
    mtp = load_file(str(model_dir / "model-mtp.safetensors"))
    own = {k.removeprefix("mtp.0."): v for k, v in mtp.items()}
    with tempfile.TemporaryDirectory() as tmp:
        deeper_dir = Path(tmp)
        cfg = dict(raw, num_hidden_layers=n + 1,
                   layer_types=[*raw["layer_types"][:n], "sliding_attention"],
                   mlp_layer_types=[*raw["mlp_layer_types"][:n], "moe"])
        (deeper_dir / "config.json").write_text(json.dumps(cfg))
        weights = {f"model.layers.{n}.{k}": v for k, v in own.items()
                   if not k.startswith(own_names)}
        for path in model_dir.glob("model*.safetensors"):
            if path.name != "model-mtp.safetensors":
                weights.update(load_file(str(path)))
        save_file(weights, str(deeper_dir / "model.safetensors"))
        deeper = transformers.AutoModelForCausalLM.from_pretrained(
            str(deeper_dir), dtype=torch.float32)
        extra = {k: torch.nn.Parameter(v.clone()) for k, v in own.items()
                 if k.startswith(own_names)}
        block = deeper.model.layers[n]
        deeper.requires_grad_(False)
        block.requires_grad_(True)
        params = [*block.parameters(), *extra.values()]
        opt = torch.optim.Adam(params, lr=lr)
        eps, hc_eps = raw["rms_norm_eps"], raw["hc_eps"]

        def norm(x, w):
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w

        data = torch.tensor(sequences)
        torch.manual_seed(seed)
        loss = torch.tensor(0.0)
        for step in range(steps):
            batch = data[torch.randint(len(data), (8,))]
            seen = {}

            def pre(module, args, batch=batch):  # the target's streams in, the MTP input out
                h = args[0][:, :-1]
                e = norm(deeper.model.embed_tokens(batch[:, 1:]), extra["enorm.weight"])
                x = norm(h, extra["hnorm.weight"]) @ extra["h_proj.weight"].T + (
                    e @ extra["e_proj.weight"].T)[..., None, :]
                return (torch.cat([x, x[:, -1:]], dim=1), *args[1:])  # (last row unused)

            def post(module, args, out, seen=seen):
                seen["out"] = out

            hooks = [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
            try:
                deeper.model(batch, use_cache=False)
            finally:
                for h in hooks:
                    h.remove()
            y = seen["out"][:, :-2]  # rows 0..L-3 predict t_2..t_{L-1}
            flat = y.flatten(-2)
            flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
            pre_w = torch.sigmoid(flat @ extra["hc_head_fn"].T * extra["hc_head_scale"]
                                  + extra["hc_head_base"]) + hc_eps
            collapsed = (pre_w[..., None] * y).sum(-2)
            logits = deeper.lm_head(norm(collapsed, extra["norm.weight"]))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                     batch[:, 2:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 50 == 0 or step == steps - 1:
                print(f"  MTP training step {step}: loss {loss.item():.3f}", flush=True)
        deeper.save_pretrained(str(deeper_dir / "out"), safe_serialization=True)
        saved = {}
        for path in (deeper_dir / "out").glob("*.safetensors"):
            saved.update(load_file(str(path)))
    layer = f"model.layers.{n}."
    tensors = {"mtp.0." + k.removeprefix(layer): v for k, v in saved.items()
               if k.startswith(layer)}
    tensors.update({"mtp.0." + k: v.detach() for k, v in extra.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(model_dir / "model-mtp.safetensors"))
    return float(loss.detach())


def train_dspark(model_dir: Path, drafter_dir: Path, sequences: list[list[int]], steps: int,
                 seed: int, lr: float = 1e-2) -> float:
    """Train the DSpark drafter (all but its embedding and head, frozen as DeepSpec freezes
    them) on the target's own greedy text: blocks anchored at random positions, teacher-forced
    Markov inputs, cross-entropy on the drafts and binary cross-entropy of the confidence head
    on whether each draft's argmax is the target's token. The target's chosen layers come from
    transformers' V4 (each layer's residual streams, flattened, as the engine reads them)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from deepinfer.workers.spec_decode.dspark_model import DSparkDrafter

    drafter = DSparkDrafter.load(str(drafter_dir), torch.float32).train()
    cfg = drafter.cfg
    drafter.requires_grad_(True)
    drafter.embed_tokens.requires_grad_(False)
    drafter.lm_head.requires_grad_(False)
    target = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                               dtype=torch.float32).eval()
    states: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[i].register_forward_hook(
        lambda m, a, out, i=i: states.__setitem__(i, out)) for i in cfg.target_layers]
    data = torch.tensor(sequences)
    with torch.no_grad():
        target.model(data, use_cache=False)
    for h in hooks:
        h.remove()
    features = torch.cat([states[i].flatten(-2) for i in cfg.target_layers], dim=-1)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    torch.manual_seed(seed)
    n, length = data.shape
    block = cfg.block
    loss = torch.tensor(0.0)
    for step in range(steps):
        s = int(torch.randint(n, ()))
        a = int(torch.randint(1, length - block, ()))
        tokens = data[s]
        ctx_rows = drafter.context(features[s, :a])
        ctx_pos = torch.arange(a)
        ctx = [layer.self_attn.keys_values(ctx_rows, ctx_pos, drafter.rope)
               for layer in drafter.layers]
        ids = torch.full((block,), cfg.mask_id, dtype=torch.long)
        ids[0] = tokens[a]
        hidden = drafter.block(ids, torch.arange(a, a + block), ctx)
        prev = tokens[a: a + block]
        labels = tokens[a + 1: a + 1 + block]
        logits = drafter.lm_head(hidden) + drafter.markov_bias(prev)
        ce = torch.nn.functional.cross_entropy(logits, labels)
        hit = (logits.argmax(-1) == labels).float()
        feats = torch.cat([hidden, drafter.markov_head.markov_w1(prev)], -1)
        conf = drafter.confidence_head.proj(feats).squeeze(-1)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, hit)
        loss = ce + bce
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  DSpark training step {step}: cross-entropy {ce.item():.3f}, confidence "
                  f"{bce.item():.3f}", flush=True)
    weights = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    save_file(weights, str(drafter_dir / "model.safetensors"))
    return float(loss.detach())


# ---------------------------------------------------------------------------- runs


def engine_args(method: str, args: argparse.Namespace, drafter: Path) -> dict:
    k = dict(num_speculative_tokens=args.num_speculative_tokens)
    return {"none": {},
            "ngram": dict(speculative_method="ngram", ngram_min=1, ngram_max=3, **k),
            "mtp": dict(speculative_method="mtp", **k),
            "dspark-fixed": dict(speculative_method="dspark", speculative_model=str(drafter),
                                 speculative_confidence_threshold=0.0, **k),
            "dspark-confidence": dict(speculative_method="dspark",
                                      speculative_model=str(drafter),
                                      speculative_confidence_threshold=args.threshold, **k),
            }[method]


def run(model: Path, method: str, args: argparse.Namespace, drafter: Path,
        prompts: list[list[int]]) -> dict:
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out: dict = {"method": method}
    with LLM(str(model), num_kv_blocks=4096, block_size=16, enable_prefix_caching=False,
             **engine_args(method, args, drafter)) as llm:
        llm.generate([prompts[0]], params)  # warm-up
        for name, batches in (("batch1", [[p] for p in prompts[: args.num_prompts]]),
                              ("concurrent", [prompts[: args.concurrency]])):
            before = llm.stats()
            t0 = time.perf_counter()
            ids = [o.token_ids for b in batches for o in llm.generate(b, params)]
            wall = time.perf_counter() - t0
            after = llm.stats()
            verify = after.spec_verify_steps - before.spec_verify_steps
            drafts = after.spec_draft_tokens - before.spec_draft_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            out[name] = dict(tok_s=sum(map(len, ids)) / wall, wall_s=wall, token_ids=ids,
                             verify_steps=verify, draft_tokens=drafts, accepted=accepted,
                             acceptance_length=(accepted / verify + 1) if verify else None,
                             acceptance_rate=(accepted / drafts) if drafts else None)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-spec-v4-"))
    model = work / "v4"
    if not (model / "config.json").exists():
        save_tiny_model(model, "deepseek_v4")
    add_mtp_weights(model)
    count = max(args.num_prompts, args.concurrency, args.train_seqs)
    seqs = greedy_sequences(model, count, args.input_len, args.output_len, args.seed)
    if "mtp" in methods and args.train_steps > 0:
        print(f"training the MTP block ({args.train_steps} steps) ...", flush=True)
        train_mtp(model, seqs[: args.train_seqs], args.train_steps, args.seed, args.lr)
    drafter = add_dspark_weights(model, work / "dspark")
    if any(m.startswith("dspark") for m in methods) and args.dspark_steps > 0:
        print(f"training the DSpark drafter ({args.dspark_steps} steps) ...", flush=True)
        train_dspark(model, drafter, seqs[: args.train_seqs], args.dspark_steps, args.seed)
    # The prompts the MTP block was trained on (their continuations are what it learned: an
    # MTP layer that agrees often, as a real checkpoint's does on real text).
    prompts = [s[: args.input_len] for s in seqs]
    results = [run(model, m, args, drafter, prompts) for m in methods]
    base = next((r for r in results if r["method"] == "none"), None)
    failed = []
    print(f"\n| method | batch-1 tok/s | concurrent ({args.concurrency}) tok/s | acceptance "
          "length (b1) | acceptance rate (b1) |")
    print("|---|---|---|---|---|")
    for r in results:
        b1, cc = r["batch1"], r["concurrent"]
        speed = (f" ({b1['tok_s'] / base['batch1']['tok_s']:.2f}x)" if base else "")
        length = f"{b1['acceptance_length']:.2f}" if b1["acceptance_length"] else "-"
        rate = f"{b1['acceptance_rate']:.2f}" if b1["acceptance_rate"] is not None else "-"
        print(f"| {r['method']} | {b1['tok_s']:.1f}{speed} | {cc['tok_s']:.1f} | {length} | "
              f"{rate} |")
        if base and r is not base and b1["token_ids"] != base["batch1"]["token_ids"]:
            failed.append(r["method"])
    for m in failed:
        print(f"FAIL: {m}'s batch-1 greedy text differs from no speculation")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(
            {"args": vars(args), "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
