"""A tiny checkpoint whose greedy reply is a fixed script, by construction: for tests that need
a model to write something a random model never would (a reasoning block, a tool call).

The default model's tokenizer, plus added (non-special) tokens such as `<think>`; a one-layer
Llama whose attention and MLP write nothing (o_proj and down_proj are zero), so the last hidden
state is the current token's embedding. The tokens of the chain (the prompt's last token, then
the script's) get orthogonal embeddings, and the LM head maps each one to the next; the last
maps to EOS. Every token of that chain must be distinct (the builder says which is not).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from deepinfer.engine.config import DEFAULT_MODEL_NAME
from deepinfer.engine.envs import cache_dir
from deepinfer.engine.model_store import prepare

# SmolLM2's chat template ends a prompt with "<|im_start|>assistant\n": its last token.
PROMPT_END = "\n"


def save_scripted_model(out: Path, script: str, added_tokens: tuple[str, ...] = (),
                        tokenizer_from: Path | None = None, prompt_end: str = PROMPT_END,
                        max_positions: int = 1024, sharpness: float = 1.0) -> Path:
    """`prompt_end`: the text whose last token the script follows (a prompt ending otherwise
    gets no script). `max_positions`: the context length (attention writes nothing, so any
    length works). `sharpness` scales the next token's logit: about 8 is greedy-only; 50 makes
    the script the sample at any temperature a client sends (real clients send their own)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    src = tokenizer_from or prepare(DEFAULT_MODEL_NAME, cache_dir())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok.save(str(out / "tokenizer.json"))
    eos = json.loads((src / "config.json").read_text())["eos_token_id"]
    chain = tok.encode(prompt_end, add_special_tokens=False).ids[-1:] + \
        tok.encode(script, add_special_tokens=False).ids
    repeated = sorted({tok.id_to_token(t) for t in chain if chain.count(t) > 1})
    if repeated:
        raise ValueError(f"the script repeats tokens {repeated}: each may appear once")
    vocab = -(-tok.get_vocab_size() // 64) * 64
    hidden = max(64, -(-(len(chain) + 1) // 16) * 16)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=eos, pad_token_id=eos, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, (token, nxt) in enumerate(zip(chain, chain[1:] + [eos])):
            embed[token] = 0.0
            embed[token, i] = 1.0  # normed to sqrt(hidden) along axis i
            head[nxt, i] = sharpness
    model.save_pretrained(str(out), safe_serialization=True)
    return out
