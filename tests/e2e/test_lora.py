"""Multi-LoRA through the real processes against HF transformers with the adapter applied by
PEFT: each request of one mixed batch (the base model and two adapters, then a third loaded at run
time) gets its own adapter's greedy tokens and logprobs; unloading waits for the adapter's
requests; the prefix cache and the KV tiers keep adapters apart; bad adapters are refused."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.config import EngineConfig, ModelConfigError
from scripts.tiny_models import save_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def make_adapter(base, out, seed: int, rank: int, targets: list[str], rslora: bool = False,
                 **config_fields):
    """A PEFT LoRA adapter of `base` with random, non-zero A and B (a trained one's shape)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             use_rslora=rslora, lora_dropout=0.0, init_lora_weights=False,
                             **config_fields)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # large enough to change greedy choices
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base, adapter, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            best = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[best]))
            tokens.append(best)
    return tokens[len(prompt):], logprobs


def assert_as_peft(base, adapters: dict, prompts: list, loras: list, outs: list) -> None:
    """Each output (12 greedy tokens) is HF + PEFT's with its request's adapter (`adapters`:
    name -> path; None: the base model): the same tokens and logprobs."""
    for prompt, lora, out in zip(prompts, loras, outs):
        tokens, logprobs = peft_greedy(base, adapters.get(lora), prompt, 12)
        assert out.token_ids == tokens, lora
        assert np.allclose([lp.chosen.logprob for lp in out.logprobs], logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base")
    a = make_adapter(base, root / "a", 1, 8, ALL)
    b = make_adapter(base, root / "b", 2, 4, ["q_proj", "v_proj", "down_proj"], rslora=True)
    return base, {"a": a, "b": b}


@pytest.mark.parametrize("limits", [{}, {"max_loras": 1, "max_cpu_loras": 1}],
                         ids=["all_loaded", "one_at_a_time"])
def test_a_mixed_batch_gives_each_request_its_adapters_output(setup, limits):
    """one_at_a_time: b waits for a's requests, then is read back in place of a."""
    base, adapters = setup
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (9, 23, 14, 30)]
    loras = [None, "a", "b", "a"]
    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
             lora_modules=[f"{k}={v}" for k, v in adapters.items()], **limits) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
    assert_as_peft(base, adapters, prompts, loras, outs)
    assert outs[1].token_ids != outs[0].token_ids  # the adapters really change the output


def test_per_module_ranks_and_alphas_serve_as_peft(setup, tmp_path):
    """rank_pattern / alpha_pattern give modules their own rank and alpha (so scale), with and
    without rsLoRA: each request of a mixed batch as HF + PEFT (tokens and logprobs)."""
    base, _ = setup
    patterns = dict(rank_pattern={"q_proj": 12, "model.layers.1.mlp.down_proj": 2},
                    alpha_pattern={"o_proj": 40, r"layers\.0\..*v_proj": 1})
    adapters = {"p": make_adapter(base, tmp_path / "p", 21, 4, ALL, **patterns),
                "r": make_adapter(base, tmp_path / "r", 22, 6, ALL, rslora=True, **patterns)}
    rng = np.random.default_rng(21)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (15, 9, 12)]
    loras = ["p", "r", None]
    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
             lora_modules=[f"{k}={v}" for k, v in adapters.items()]) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
    assert_as_peft(base, adapters, prompts, loras, outs)


def test_an_adapter_read_back_gone_or_changed_fails_its_requests_alone(setup, tmp_path):
    """One adapter resident at a time: x's files replaced by other weights after x was evicted
    (its cached prefix names the old ones), then y's directory deleted after y was evicted: each
    one's request fails naming the problem, a base-model request sent with it answers as HF, and
    the engine serves on."""
    base, adapters = setup
    x, y, z = (shutil.copytree(adapters[k], tmp_path / n) for k, n in (("a", "x"), ("b", "y"),
                                                                       ("a", "z")))
    rng = np.random.default_rng(22)
    prompt, other = rng.integers(3, 40000, 33).tolist(), rng.integers(3, 40000, 10).tolist()

    def together(llm, lora: str) -> Exception:
        """The adapter's request (it must fail) and a base-model one sent with it."""
        with ThreadPoolExecutor(2) as pool:
            failing = pool.submit(llm.generate, [prompt], SamplingParams(lora=lora, **GREEDY))
            plain = pool.submit(llm.generate, [other], SamplingParams(**GREEDY))
            assert plain.result()[0].token_ids == peft_greedy(base, None, other, 12)[0]
            return failing.exception()

    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True, max_loras=1,
             max_cpu_loras=1, lora_modules=[f"x={x}", f"y={y}", f"z={z}"]) as llm:
        first = llm.generate([prompt], SamplingParams(lora="x", **GREEDY))[0]
        assert first.token_ids == peft_greedy(base, adapters["a"], prompt, 12)[0]
        llm.generate([other], SamplingParams(lora="y", **GREEDY))  # x evicted
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(adapters["b"] / file, x / file)
        error = together(llm, "x")
        assert error is not None and "files changed since it was loaded" in str(error)
        llm.generate([other], SamplingParams(lora="z", **GREEDY))  # y evicted
        shutil.rmtree(y)
        error = together(llm, "y")
        assert error is not None and "not a PEFT LoRA adapter" in str(error)
        again = llm.generate([prompt], SamplingParams(lora="z", **GREEDY))[0]
    assert again.token_ids == first.token_ids  # z holds a's weights


def test_the_prefix_cache_keeps_adapters_apart(setup):
    base, adapters = setup
    prompt = np.random.default_rng(1).integers(3, 40000, 40).tolist()
    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
             lora_modules=[f"{k}={v}" for k, v in adapters.items()]) as llm:
        first = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
        other = llm.generate([prompt], SamplingParams(lora="b", **GREEDY))[0]
        again = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
    assert first.cached_tokens == 0 and other.cached_tokens == 0  # b never reads a's KV
    assert again.cached_tokens == 36 and again.token_ids == first.token_ids
    assert other.token_ids == peft_greedy(base, adapters["b"], prompt, 12)[0]


def test_an_unknown_adapter_is_refused(setup):
    base, adapters = setup
    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
             lora_modules=[f"a={adapters['a']}"]) as llm:
        with pytest.raises(Exception, match="no LoRA adapter 'zzz'"):
            llm.generate([[5, 6, 7]], SamplingParams(lora="zzz", **GREEDY))


def test_bad_adapters_are_refused_at_start_naming_the_problem(setup, tmp_path):
    base, adapters = setup
    big = make_adapter(base, tmp_path / "big", 3, 32, ["q_proj"])
    other_base = save_tiny_model(tmp_path / "wide", hidden_size=96)
    foreign = make_adapter(other_base, tmp_path / "foreign", 4, 4, ["q_proj"])
    cases = [([f"x={tmp_path / 'nowhere'}"], "not a PEFT adapter"),
             ([f"x={big}"], "rank 32 is above --max-lora-rank 16"),
             ([f"x={foreign}"], "another base model"),
             (["x"], "NAME=PATH")]
    for modules, message in cases:
        with pytest.raises((ModelConfigError, Exception), match=message):
            with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
                     lora_modules=modules) as llm:
                llm.generate([[5, 6]], SamplingParams(**GREEDY))
    with pytest.raises(ModelConfigError, match="--enable-lora"):
        EngineConfig(model=str(base), lora_modules=[f"a={adapters['a']}"]).check_lora()
    # A request naming it would reach the base model: refused at start.
    for served, name in ((None, base.name), ("tiny", "tiny"), ("tiny", str(base))):
        with pytest.raises(ModelConfigError, match="is the served model's name"):
            EngineConfig(model=str(base), served_model_name=served, enable_lora=True,
                         lora_modules=[f"{name}={adapters['a']}"]).check_lora()
    for limits in ({"max_cpu_loras": 1}, {"max_cpu_loras": 1, "max_loras": 2}):
        with pytest.raises(ModelConfigError, match="--max-cpu-loras needs --max-loras"):
            EngineConfig(model=str(base), enable_lora=True, **limits).check_lora()


@pytest.fixture(scope="module")
def server(setup):
    """A real server of the tiny model serving a and b, adapters changeable at run time."""
    from scripts.server_process import ServerProcess

    base, adapters = setup
    server = ServerProcess(base, "--served-model-name", "tiny", "--num-kv-blocks", "128",
                           "--enable-lora", "--allow-runtime-lora-updating", "--lora-modules",
                           *[f"{k}={v}" for k, v in adapters.items()])
    yield server
    server.stop()


def complete(server, model: str, prompt: list[int], n: int = 12, **extra) -> dict:
    import httpx

    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def served_models(server) -> list[tuple[str, str | None]]:
    import httpx

    models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    return [(m["id"], m["parent"]) for m in models]


def test_the_server_picks_the_adapter_by_model_and_lists_it(setup, server):
    import httpx
    from transformers import AutoTokenizer

    base, adapters = setup
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = np.random.default_rng(2).integers(3, 40000, 17).tolist()
    assert served_models(server) == [("tiny", None), ("a", "tiny"), ("b", "tiny")]
    listing = httpx.get(f"{server.base_url}/v1/models").text
    assert str(adapters["a"]) not in listing and str(base) not in listing  # no server paths
    for name in ("tiny", "a", "b"):
        expected = peft_greedy(base, adapters.get(name), prompt, 12)[0]
        assert complete(server, name, prompt)["text"] == tokenizer.decode(expected)
    r = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": "c", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # Per adapter: one request each, its 17 prompt and 12 generated tokens.
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "deepinfer_lora_adapters_loaded 2.0" in metrics
    assert "deepinfer_lora_load_seconds_count 2.0" in metrics  # a and b, at start
    for name in ("a", "b"):
        for metric, value in (("requests", 1), ("prompt_tokens", 17),
                              ("generation_tokens", 12)):
            line = f'deepinfer_lora_{metric}_total{{adapter="{name}"}} {float(value)}'
            assert line in metrics, line
    assert 'adapter="tiny"' not in metrics  # the base model is not an adapter
    # Each response names the adapter that answered (as vLLM's do), or the served model.
    for name, path in (("a", "/v1/chat/completions"), ("b", "/v1/completions"),
                       (str(base), "/v1/completions"), ("a", "/v1/responses"),
                       ("b", "/v1/messages")):
        body = {"model": name, "max_tokens": 2, "stream": False}
        if path == "/v1/completions":
            body["prompt"] = "hi"
        elif path == "/v1/responses":
            body = {"model": name, "input": "hi", "max_output_tokens": 2}
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            body["stream"] = stream
            r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            want = "tiny" if name == str(base) else name
            assert f'"model":"{want}"' in r.text.replace(" ", ""), (path, stream, r.text)
            assert '"model":"tiny"' not in r.text.replace(" ", "") or want == "tiny"


def test_an_adapter_loaded_at_run_time_serves_in_a_mixed_batch(setup, server, tmp_path):
    """c is loaded through the API, then the base model, a, b and c answer together, each as
    HF + PEFT with that adapter (tokens and logprobs)."""
    import httpx
    from transformers import AutoTokenizer

    base, adapters = setup
    c = make_adapter(base, tmp_path / "c", 7, 16, ["q_proj", "o_proj", "up_proj", "down_proj"])
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "c", "lora_path": str(c)})
    assert r.status_code == 200 and "added successfully" in r.text
    assert served_models(server)[-1] == ("c", "tiny")
    prompts = [np.random.default_rng(10 + i).integers(3, 40000, 11 + 5 * i).tolist()
               for i in range(4)]
    names, paths = ["tiny", "a", "b", "c"], [None, adapters["a"], adapters["b"], c]
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(lambda i: complete(server, names[i], prompts[i], logprobs=0),
                                range(4)))
    tokenizer = AutoTokenizer.from_pretrained(base)
    for prompt, path, choice in zip(prompts, paths, choices):
        tokens, logprobs = peft_greedy(base, path, prompt, 12)
        assert choice["text"] == tokenizer.decode(tokens), path
        assert np.allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=1e-4)
    assert choices[3]["text"] != choices[0]["text"]  # c really changes the output
    r = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", timeout=60,
                   json={"lora_name": "c"})
    assert r.status_code == 200


def test_unloading_waits_for_the_adapters_requests_and_loading_works_under_load(
        setup, server, tmp_path):
    """Streams of d run while d is unloaded and e is loaded: every stream ends whole and equal
    to PEFT's; d is refused once its unload began; e answers as PEFT; d loads again."""
    import httpx
    from transformers import AutoTokenizer

    base, _ = setup
    tokenizer = AutoTokenizer.from_pretrained(base)
    d = make_adapter(base, tmp_path / "d", 8, 8, ALL)
    e = make_adapter(base, tmp_path / "e", 9, 4, ["v_proj", "gate_proj"])
    url = server.base_url
    assert httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "d", "lora_path": str(d)}).status_code == 200
    prompts = [np.random.default_rng(20 + i).integers(3, 40000, 9 + i).tolist() for i in range(3)]
    started = threading.Barrier(len(prompts) + 1)

    def stream(prompt: list[int]) -> tuple[str, list[float]]:
        """The stream's text and its tokens' logprobs."""
        text, logprobs = "", []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "d", "prompt": prompt, "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 0}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])["choices"][0]
                text += chunk["text"]
                if chunk["logprobs"] is not None:
                    if not logprobs:
                        started.wait()  # running: the unload starts after each one's first token
                    logprobs += chunk["logprobs"]["token_logprobs"]
        return text, logprobs

    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(stream, p) for p in prompts]
        started.wait()
        with ThreadPoolExecutor(2) as updates:
            unload = updates.submit(httpx.post, f"{url}/v1/unload_lora_adapter", timeout=120,
                                    json={"lora_name": "d"})
            load = updates.submit(httpx.post, f"{url}/v1/load_lora_adapter", timeout=120,
                                  json={"lora_name": "e", "lora_path": str(e)})
            assert load.result().status_code == 200
            while ("d", "tiny") in served_models(server):  # the unload has begun
                time.sleep(0.01)
            r = httpx.post(f"{url}/v1/completions", json={"model": "d", "prompt": [5, 6],
                                                          "max_tokens": 1})
            assert r.status_code == 404
            assert unload.result().status_code == 200
        for prompt, future in zip(prompts, streams):
            text, logprobs = future.result()
            want_tokens, want_logprobs = peft_greedy(base, d, prompt, 64)
            assert len(logprobs) == 64 and np.allclose(logprobs, want_logprobs, atol=1e-4)
            # (a stream leaves out a last, incomplete UTF-8 character that decode shows as �)
            assert tokenizer.decode(want_tokens).startswith(text) and len(text) > 64
    prompt = prompts[0]
    assert complete(server, "e", prompt)["text"] == tokenizer.decode(
        peft_greedy(base, e, prompt, 12)[0])
    assert served_models(server)[-1] == ("e", "tiny")
    assert httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "d", "lora_path": str(d)}).status_code == 200
    assert complete(server, "d", prompt)["text"] == tokenizer.decode(
        peft_greedy(base, d, prompt, 12)[0])
    for name in ("d", "e"):
        assert httpx.post(f"{url}/v1/unload_lora_adapter",
                          json={"lora_name": name}).status_code == 200


def test_structured_output_constrains_an_adapters_answer(server):
    """A JSON schema on a request of adapter a: the answer parses and validates."""
    import httpx
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "model": "a", "messages": [{"role": "user", "content": "a number"}], "max_tokens": 60,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_bad_adapters_loaded_at_run_time_are_400s_naming_the_problem(setup, server, tmp_path):
    import httpx
    from safetensors.torch import load_file, save_file

    base, adapters = setup
    big = make_adapter(base, tmp_path / "big", 3, 32, ["q_proj"])
    foreign = make_adapter(save_tiny_model(tmp_path / "wide", hidden_size=96),
                           tmp_path / "foreign", 4, 4, ["q_proj"])
    missing = tmp_path / "missing"  # a's files naming a layer the model lacks
    shutil.copytree(adapters["a"], missing)
    weights = load_file(missing / "adapter_model.safetensors")
    save_file({k.replace("layers.0.", "layers.99."): v for k, v in weights.items()},
              missing / "adapter_model.safetensors")
    experts = tmp_path / "experts"  # as PEFT adapts a MoE model's experts
    shutil.copytree(adapters["a"], experts)
    save_file({k.replace("mlp.down_proj", "mlp.experts.down_proj"): v for k, v in
               weights.items()}, experts / "adapter_model.safetensors")
    damaged = tmp_path / "damaged"
    shutil.copytree(adapters["a"], damaged)
    (damaged / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = [(tmp_path / "nowhere", "not a PEFT LoRA adapter"),
             (big, "rank 32 is above --max-lora-rank 16"),
             (foreign, "another base model"),
             (missing, "the model has no model.layers.99"),
             (damaged, "cannot read the adapter"),
             (experts, "adapts MoE experts"),
             (adapters["a"], "already loaded")]
    for i, (path, message) in enumerate(cases):
        name = "a" if message == "already loaded" else f"bad{i}"
        r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert served_models(server) == [("tiny", None), ("a", "tiny"), ("b", "tiny")]
    assert complete(server, "tiny", [5, 6, 7], n=2)  # still serving


def test_the_host_tier_keeps_adapters_apart(setup):
    """24 device blocks of 4 tokens: each 60-token prompt evicts the previous one's blocks to the
    host tier; a's come back for a, never for b or the base model."""
    base, adapters = setup
    rng = np.random.default_rng(5)
    prompt, other, third = (rng.integers(3, 40000, 60).tolist() for _ in range(3))
    with LLM(str(base), num_kv_blocks=24, block_size=4, host_kv_cache_gb=0.0002,
             enable_lora=True, lora_modules=[f"{k}={v}" for k, v in adapters.items()]) as llm:
        first = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
        llm.generate([other], SamplingParams(**GREEDY))
        llm.generate([third], SamplingParams(**GREEDY))
        again = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
        as_b = llm.generate([prompt], SamplingParams(lora="b", **GREEDY))[0]
        as_base = llm.generate([prompt], SamplingParams(**GREEDY))[0]
        stats = llm.stats()
    assert stats.host_blocks_in >= 10 and again.cached_tokens >= 40
    assert again.token_ids == first.token_ids
    assert as_b.cached_tokens == 0 and as_base.cached_tokens == 0
    assert as_b.token_ids == peft_greedy(base, adapters["b"], prompt, 12)[0]
    assert as_base.token_ids == peft_greedy(base, None, prompt, 12)[0]


def test_the_disk_tier_names_blocks_by_the_adapters_content(setup, tmp_path):
    """After a restart, a's blocks are read back from disk for a; the name a over other weights
    (b's files) is another adapter: no hit, its own output."""
    base, adapters = setup
    prompt = np.random.default_rng(6).integers(3, 40000, 41).tolist()
    disk = tmp_path / "kv"
    disk.mkdir()

    def engine(path):
        return LLM(str(base), num_kv_blocks=64, block_size=4, kv_disk_path=str(disk),
                   enable_lora=True, lora_modules=[f"a={path}"])

    with engine(adapters["a"]) as llm:
        first = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
    with engine(adapters["a"]) as llm:
        again = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
        base_run = llm.generate([prompt], SamplingParams(**GREEDY))[0]
        hits = llm.stats().disk_hit_tokens
    assert again.cached_tokens == 40 and hits == 40 and again.token_ids == first.token_ids
    assert base_run.cached_tokens == 0  # the base model never reads a's blocks
    with engine(adapters["b"]) as llm:
        renamed = llm.generate([prompt], SamplingParams(lora="a", **GREEDY))[0]
    assert renamed.cached_tokens == 0
    assert renamed.token_ids == peft_greedy(base, adapters["b"], prompt, 12)[0]


def fp8_exact_model(base, out):
    """`base` with every matrix on fp8's grid times 2^-7, each row reaching 448 * 2^-7: fp8
    quantization with 128 x 128 block scales (--quantization fp8) is then lossless, so HF + PEFT
    on the float checkpoint is the exact reference for adapters over fp8 base weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                grid = (p / p.abs().amax() * 448).to(torch.float8_e4m3fn).float()
                grid[:, 0] = 448.0  # every block's max: its scale is exactly 2^-7
                p.copy_(grid * 2.0**-7)
    model.save_pretrained(out)
    for file in base.iterdir():
        if "token" in file.name or file.name == "chat_template.jinja":
            shutil.copy(file, out / file.name)
    return out


def test_adapters_over_fp8_base_weights_equal_peft(setup, tmp_path):
    """The linears multiply fp8 weights (QuantizedMatmul) and the adapters add their products:
    each request of a mixed batch as HF + PEFT (tokens and logprobs)."""
    base = fp8_exact_model(setup[0], tmp_path / "fp8")
    adapter = make_adapter(base, tmp_path / "a", 11, 8, ALL)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (13, 7, 21)]
    loras = ["a", None, "a"]
    with LLM(str(base), num_kv_blocks=64, block_size=4, quantization="fp8", enable_lora=True,
             lora_modules=[f"a={adapter}"]) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
    assert_as_peft(base, {"a": adapter}, prompts, loras, outs)
    assert outs[0].token_ids != peft_greedy(base, None, prompts[0], 12)[0]


def test_a_draft_model_speculates_for_adapters_without_them(setup):
    """The draft (the base model, no adapter) proposes, the target with each request's adapter
    verifies: greedy output equal to HF + PEFT, and drafts accepted."""
    base, adapters = setup
    rng = np.random.default_rng(13)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (10, 16, 12)]
    loras = ["a", None, "b"]
    with LLM(str(base), num_kv_blocks=128, block_size=4, enable_lora=True,
             lora_modules=[f"{k}={v}" for k, v in adapters.items()],
             speculative_method="draft", speculative_model=str(base),
             num_speculative_tokens=3) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
        stats = llm.stats()
    assert_as_peft(base, adapters, prompts, loras, outs)
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0


def test_two_tensor_parallel_ranks_shard_the_adapters_as_their_linears(setup):
    """A and B split as each linear's weight is (B's rows of q|k|v and gate|up, A's columns of
    o and down, whose partial products the all-reduce sums): each request as HF + PEFT."""
    base, adapters = setup
    rng = np.random.default_rng(14)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (11, 19, 8)]
    loras = ["a", "b", None]
    with LLM(str(base), tensor_parallel_size=2, num_kv_blocks=64, block_size=4,
             enable_lora=True, lora_modules=[f"{k}={v}" for k, v in adapters.items()]) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
    assert_as_peft(base, adapters, prompts, loras, outs)


FAMILIES = {  # arch -> (tiny model overrides, the adapter's targets)
    "qwen3": ({}, ALL),  # q/k norms after the adapted projections
    "gemma3": ({}, ALL),  # GeGLU, sandwich norms, sliding-window layers
    # MoE: attention (adapters of the experts, PEFT's target_parameters, are refused)
    "qwen3_moe": (dict(num_key_value_heads=2), ["q_proj", "k_proj", "v_proj", "o_proj"]),
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_each_family_serves_adapters_as_peft(arch, tmp_path):
    overrides, targets = FAMILIES[arch]
    base = save_tiny_model(tmp_path / arch, arch, **overrides)
    adapter = make_adapter(base, tmp_path / "a", 15, 8, targets)
    rng = np.random.default_rng(16)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (12, 9)]
    loras = ["a", None]
    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
             lora_modules=[f"a={adapter}"]) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
    assert_as_peft(base, {"a": adapter}, prompts, loras, outs)
    assert outs[0].token_ids != peft_greedy(base, None, prompts[0], 12)[0]


def test_a_prefill_and_a_decode_server_serve_adapters_as_peft(setup):
    """--prefill-servers 1 --decode-servers 1: the prefill server computes each prompt with the
    request's adapter, the decode server continues it with the same one (the KV's adapter is
    checked): greedy text equal to HF + PEFT."""
    import httpx
    from transformers import AutoTokenizer

    from scripts.server_process import ServerProcess, disaggregation_roles

    base, adapters = setup
    tokenizer = AutoTokenizer.from_pretrained(base)
    server = ServerProcess(base, "--served-model-name", "tiny", "--num-kv-blocks", "128",
                           "--kv-transfer-timeout", "10", "--prefill-servers", "1",
                           "--decode-servers", "1", "--enable-lora", "--lora-modules",
                           *[f"{k}={v}" for k, v in adapters.items()],
                           env={"DEEPINFER_CLUSTER_SECRET": "lora-pd-test-secret"})
    try:
        rng = np.random.default_rng(17)
        for name in ("a", "b", "tiny"):
            prompt = rng.integers(3, 40000, 14).tolist()
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            expected = peft_greedy(base, adapters.get(name), prompt, 12)[0]
            assert r.json()["choices"][0]["text"] == tokenizer.decode(expected), name
        decode = disaggregation_roles(server.proc.pid)["decode"][1]
        metrics = httpx.get(f"{decode}/metrics").text  # the prompts' KV came from the prefill
        (pulled,) = [line for line in metrics.splitlines()
                     if line.startswith("deepinfer_kv_transfer_blocks_total ")]
        assert float(pulled.split()[1]) >= 3  # a block (of 16 tokens) per request at least
    finally:
        server.stop()



def test_mtp_heads_speculate_for_adapters(tmp_path):
    """DeepSeek-V3 with an MTP layer: the heads propose without the adapter (from the hidden
    states the adapted model computed), the target verifies with it: PEFT's greedy tokens."""
    from scripts.tiny_models import add_mtp_weights

    base = save_tiny_model(tmp_path / "ds", "deepseek_v3")
    add_mtp_weights(base)
    adapter = make_adapter(base, tmp_path / "a", 3, 8, ["o_proj"])  # MLA's adapted projection
    rng = np.random.default_rng(18)
    prompts = [rng.integers(3, 40000, n).tolist() for n in (10, 13)]
    loras = ["a", None]
    with LLM(str(base), num_kv_blocks=64, block_size=4, enable_lora=True,
             lora_modules=[f"a={adapter}"], speculative_method="mtp",
             num_speculative_tokens=2) as llm:
        outs = llm.generate(prompts, [SamplingParams(lora=lo, **GREEDY) for lo in loras])
        assert llm.stats().spec_draft_tokens > 0
    assert_as_peft(base, {"a": adapter}, prompts, loras, outs)
    assert outs[0].token_ids != peft_greedy(base, None, prompts[0], 12)[0]
