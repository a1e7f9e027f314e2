"""The one-call native decode layer against the model's Python layers, step by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import (
    NewRequestInfo,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    pack_ids,
)
from deepinfer.kernels.cpu import decode_layer as cpu_decode_layer
from deepinfer.kernels.cpu import kquant_linear
from scripts.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_decode_layer.available(), reason=f"not built: {cpu_decode_layer.build_error()}"
)


def prompt_then_decodes(prompts: dict[str, list[int]], steps: int,
                        rng: np.random.Generator) -> list[StepPlan]:
    """One step prefilling every prompt (10 blocks a request), then `steps` decode steps."""
    tables = {rid: np.arange(10 * i, 10 * i + 10, dtype=np.int32) for i, rid in enumerate(prompts)}

    def seq(rid: str, tokens: list[int], start: int) -> ScheduledSeq:
        return ScheduledSeq(rid, pack_ids(tokens), start, [tables[rid].tobytes()], True)

    news = [NewRequestInfo(rid, pack_ids(p), SamplingParams(max_tokens=20))
            for rid, p in prompts.items()]
    plans = [StepPlan(0, [seq(rid, p, 0) for rid, p in prompts.items()], new_requests=news)]
    for step in range(steps):
        plans.append(StepPlan(step + 1, [seq(rid, [int(rng.integers(3, 40000))], len(p) + step)
                                         for rid, p in prompts.items()]))
    return plans


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("mistral", dict(sliding_window=7)),  # every layer sliding: window bounds per row
    ("qwen2", dict(num_key_value_heads=2)),  # q/k/v biases
])
@pytest.mark.parametrize("batch", [2, 6])  # small-M kernel / oneDNN-packed linears
@pytest.mark.parametrize("copies", ["both", "packed", "plain"])  # weight copies kept
def test_matches_python_layers(tmp_path, arch: str, overrides: dict, batch: int,
                               copies: str) -> None:
    from deepinfer.workers.model_runner import ModelRunner

    model_dir = save_tiny_model(tmp_path, arch, **overrides)
    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=4,  # 10 a request
                       cpu_linear_weights=copies)
    fast, slow = ModelRunner(cfg), ModelRunner(cfg)
    assert fast.model.model.fast_layers, "the one-call decode layer should be in use"
    slow.model.model.fast_layers = None  # the Python layers

    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(3, 40000, int(rng.integers(5, 22))).tolist()
               for i in range(batch)}
    for plan in prompt_then_decodes(prompts, 12, rng):
        ours = fast.all_logits(plan)
        ref = slow.all_logits(plan)
        assert (ours - ref).abs().max().item() < 1e-4, f"step {plan.step_id}"
    for (k_fast, v_fast), (k_slow, v_slow) in zip(fast.kv_caches, slow.kv_caches):
        torch.testing.assert_close(k_fast, k_slow, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_fast, v_slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization,batch", [("int8", 3), ("fp8", 3), ("int8", 6)])
def test_quantized_weights_match_python_layers(tmp_path, quantization: str, batch: int) -> None:
    """Quantized linears inside the one-call layer against the Python layers calling the same
    kernels one by one: at most 4 rows (the small-M kernels), and 6 (int8: the int8 GEMM; the
    one-call layer takes int8 weights at any batch)."""
    from deepinfer.workers.model_runner import ModelRunner

    model_dir = save_tiny_model(tmp_path, "qwen2", num_key_value_heads=2, intermediate_size=128)
    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=4,
                       quantization=quantization)
    fast, slow = ModelRunner(cfg), ModelRunner(cfg)
    assert fast.model.model.fast_layers, "the one-call decode layer should be in use"
    assert fast.model.model.layers[0].mlp.down_proj.quant.weight.kind == quantization
    slow.model.model.fast_layers = None
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": rng.integers(3, 40000, 9).tolist() for i in range(batch)}
    check_decodes_match(fast, slow, prompts, 7, rng, 1e-4)


def check_decodes_match(fast, slow, prompts: dict[str, list[int]], steps: int,
                        rng: np.random.Generator, tol: float, relative: bool = False) -> None:
    """Prefill then `steps` decodes on both runners: every step's logits within `tol` (times
    the reference's largest logit, when above 1, if `relative`), and every decode step of
    `fast` through its one-call layer."""
    model, one_call = fast.model.model, []
    inner = model._decode_fast
    model._decode_fast = lambda *a: one_call.append(1) or inner(*a)
    for plan in prompt_then_decodes(prompts, steps, rng):
        ours, ref = fast.all_logits(plan), slow.all_logits(plan)
        scale = max(1.0, ref.abs().max().item()) if relative else 1.0
        assert (ours - ref).abs().max().item() < tol * scale, f"step {plan.step_id}"
    assert len(one_call) == steps


# GGUF K-quant types and a bf16 weight, cycled over a layer's parts (q, k, v; gate, up; ...)
_PART_TYPES = [12, 14, 13, None]  # Q4_K, Q6_K, Q5_K, bf16


def _part_weight(kind: int | None, rows: int, cols: int, rng: np.random.Generator):
    """Random super-blocks with small fp16 factors like a trained layer's (any codes are
    valid), or a bf16 weight."""
    from deepinfer.workers.quantization.weight import KQUANTS, QuantizedWeight

    if kind is None:
        return QuantizedWeight(torch.from_numpy(
            rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).bfloat16(), None)
    size = KQUANTS[kind][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in ((208,) if kind == 14 else (0, 2)):
        d = rng.uniform(1e-4, 1e-3, (rows, cols // 256, 1)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8)
    return QuantizedWeight(torch.from_numpy(raw.reshape(rows, -1)), None, None, kind)


def _as_kquant_parts(runner, seed: int, pack: bool = True) -> None:
    """Every decoder linear becomes parts of mixed K-quant / bf16 weights (as a Q4_K_M file's
    q | k | v), the same for every runner given the same seed; `pack`: K-quant parts keep
    their lanes copy."""
    from deepinfer.workers.layers.linear import Linear

    rng = np.random.default_rng(seed)
    n = 0
    for mod in runner.model.model.layers.modules():
        if not isinstance(mod, Linear):
            continue
        rows = ({name: size for name, (_, size) in mod.parts.items()}
                if getattr(mod, "parts", None) else {"w": mod.out_features})
        mod.quantized_parts = {}
        for name, r in rows.items():
            mod.quantized_parts[name] = _part_weight(_PART_TYPES[n % 4], r, mod.in_features, rng)
            n += 1
        assert mod._finalize_quantized(None, pack=pack)
    runner.model.model.finalize()


@pytest.mark.parametrize("batch", [4, 20])  # the parts' small-M kernels / their GEMM paths
@pytest.mark.parametrize("pack", [False, True], ids=["blocks", "lanes"])
def test_kquant_and_bf16_parts_match_python_layers(tmp_path, batch: int, pack: bool) -> None:
    """GGUF K-quant and bf16 linears (parts of mixed types side by side) inside the one-call
    layer against the Python layers calling the same kernels one by one: on the blocks as
    stored, or (`pack`) on their lanes copies."""
    from deepinfer.workers.model_runner import ModelRunner

    model_dir = save_tiny_model(tmp_path, "llama", hidden_size=256, intermediate_size=512,
                                num_hidden_layers=2)
    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=10 * batch, block_size=4)
    fast, slow = ModelRunner(cfg), ModelRunner(cfg)
    _as_kquant_parts(fast, 5, pack)
    _as_kquant_parts(slow, 5, pack)
    layer = fast.model.model.fast_layers[0]
    lanes = [t for t in layer.qkv.part_lanes if t.numel()]
    assert bool(lanes) == (pack and kquant_linear.int8_gemm())
    assert set(layer.qkv.part_kinds) == {12, 14, 13} and 0 in layer.gate_up.part_kinds + \
        layer.down.part_kinds + layer.o.part_kinds, "every kind of part should be in use"
    slow.model.model.fast_layers = None
    rng = np.random.default_rng(2)
    prompts = {f"r{i}": rng.integers(3, 40000, 5).tolist() for i in range(batch)}
    check_decodes_match(fast, slow, prompts, 4, rng, 1e-4, relative=True)
