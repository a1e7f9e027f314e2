"""A whole model through the Triton kernels, as a GPU worker runs it: every native CPU op off,
attention through the Triton backend and the norms, rotary + KV store and SiLU·mul through
workers/layers/gpu_kernels.py (all on CPU under TRITON_INTERPRET=1), prompts in chunks and then
decode steps, logits held to HF transformers."""

from __future__ import annotations

import numpy as np
import pytest

from scripts.tiny_models import save_tiny_model
from tests.kernels.triton.device import DEVICE  # sets TRITON_INTERPRET before any kernel
from tests.workers.engine_steps import run_engine
from tests.workers.models.test_model_vs_hf import hf_logits

CONFIGS = {
    "llama": ("llama", {}),
    "mistral-sliding-window": ("mistral", dict(sliding_window=7)),
    "deepseek-v3-mla": ("deepseek_v3", {}),  # MLA decode rows: kernels/triton/mla_decode.py
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_triton_backend_logits_match_hf(name, tmp_path, monkeypatch) -> None:
    from deepinfer.kernels.cpu.native import NativeOp
    from deepinfer.workers import model_runner
    from deepinfer.workers.attention.triton_backend import TritonAttention
    from deepinfer.workers.layers import gpu_kernels

    monkeypatch.setattr(NativeOp, "available", lambda self, *tensors: False)
    monkeypatch.setattr(gpu_kernels, "wanted", lambda t: True)
    called = set()
    for op in ("add_rms_norm", "rope_store_kv", "silu_and_mul"):
        kernel = getattr(gpu_kernels, op)
        monkeypatch.setattr(gpu_kernels, op, lambda *a, _k=kernel, _n=op: called.add(_n) or _k(*a))
    launches = []

    def triton_backend(device, dtype):
        backend = TritonAttention(DEVICE)
        launches.append(backend)
        return backend

    monkeypatch.setattr(model_runner, "select_backend", triton_backend)
    arch, overrides = CONFIGS[name]
    model_dir = save_tiny_model(tmp_path, arch, **overrides)
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist() for i, n in enumerate([13, 4])}
    runner, logits, tokens, steps = run_engine(model_dir, prompts, max_tokens=4)
    assert launches and runner.attention is launches[0] and steps > 4
    from deepinfer.workers.cuda_graphs import DecodeGraphs

    assert runner.graphs is None  # graphs are captured on CUDA devices only
    # MLA indexes its decode rows from the host, MoE routing syncs: no graphs for them
    assert DecodeGraphs.supported(runner.model, 1) == (arch != "deepseek_v3")
    assert not DecodeGraphs.supported(runner.model, 2)  # no collectives inside a graph yet
    # MLA rotates a rope key narrower than its latent "value": the reference path, by design
    assert called == {"add_rms_norm", "rope_store_kv", "silu_and_mul"} - (
        {"rope_store_kv"} if arch == "deepseek_v3" else set())
    for rid, ids in prompts.items():
        ref = hf_logits(model_dir, ids + tokens[rid][:-1])  # teacher-forced on our tokens
        assert logits[rid].shape == ref.shape
        diff = (logits[rid] - ref).abs().max().item()
        # float32 throughout: only the reductions' order differs (~1e-6); a wrong table, key
        # range, mask or latent moves these logits by 1e-2 or more.
        assert diff < 1e-3, f"{rid}: max abs logit diff {diff}"


@pytest.mark.parametrize("name", ["llama", "mistral-sliding-window"])
def test_decode_graph_buffers_match_hf(name, tmp_path, monkeypatch) -> None:
    """workers/cuda_graphs.py's padded static buffers, run eagerly (no graph can be captured
    on CPU): decode steps of 2 rows in the 4-row buffers, tables padded to the longest context,
    the padding rows seeing no key and writing no slot; logits still HF's."""
    import torch

    from deepinfer.workers import model_runner
    from deepinfer.workers.attention.triton_backend import TritonAttention
    from deepinfer.workers.cuda_graphs import DecodeGraphs

    monkeypatch.setattr(model_runner, "select_backend", lambda device, dtype: TritonAttention(
        DEVICE))
    replays = []

    def graphs(self):
        assert DecodeGraphs.supported(self.model, 1)
        g = DecodeGraphs(self.model, self.kv_caches, [1, 4], 40, self.windows, self.block_size,
                         torch.device(DEVICE), capture=False)
        run = g.run

        def counted(*args):
            out = run(*args)
            replays.append(out is not None)
            return out

        g.run = counted
        return g

    monkeypatch.setattr(model_runner.ModelRunner, "_decode_graphs", graphs)
    arch, overrides = CONFIGS[name]
    model_dir = save_tiny_model(tmp_path, arch, **overrides)
    rng = np.random.default_rng(2)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist() for i, n in enumerate([9, 6])}
    _, logits, tokens, _ = run_engine(model_dir, prompts, max_tokens=5)
    assert sum(replays) >= 3  # decode-only steps took the buffers; prefills did not
    for rid, ids in prompts.items():
        ref = hf_logits(model_dir, ids + tokens[rid][:-1])
        diff = (logits[rid] - ref).abs().max().item()
        assert diff < 1e-3, f"{rid}: max abs logit diff {diff}"
