"""Fused experts against a per-token reference; both checkpoint layouts of the experts load."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deepinfer.kernels.cpu import fused as cpu_fused
from deepinfer.kernels.cpu import linear as cpu_linear
from deepinfer.workers.layers.moe import fused_experts, route
from scripts.tiny_models import save_tiny_model

NATIVE = cpu_linear.available() and cpu_fused.available()


def naive_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not NATIVE, reason="native CPU ops not built"))])
@pytest.mark.parametrize("tokens,unused", [(1, ()), (3, (1, 5)), (37, (0, 6, 7)), (40, ())])
def test_fused_experts_match_per_token_reference(tokens: int, unused: tuple[int, ...],
                                                 native: bool) -> None:
    """1 token (a decode), a few (the small-M kernel per expert), many (GEMMs per expert, as a
    prefill chunk mixed with decodes); `unused` experts get no tokens."""
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 24, 16, 2
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, list(unused)] = -torch.inf
    weights, ids = route(logits, top_k, renormalize=tokens % 2 == 0)
    assert not set(unused) & set(ids.flatten().tolist())
    ours = fused_experts(x, gate_up, down, weights, ids, native)
    torch.testing.assert_close(ours, naive_experts(x, gate_up, down, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_route_renormalizes_the_top_k() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, probs[:, [3, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, [3, 2]] / probs[:, [3, 2]].sum())


def fuse_expert_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with each layer's per-expert weights stacked as HF keeps them in memory:
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]."""
    per_expert = re.compile(
        r"(.+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
        r"\.weight")
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = per_expert.fullmatch(name)
        if m is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
        else:
            part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m[3], m[3])
            parts.setdefault(m[1], {}).setdefault(part, {})[int(m[2])] = tensor
    for layer, by_part in parts.items():
        stack = {p: torch.stack([t for _, t in sorted(by_part[p].items())]) for p in by_part}
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack["down_proj"]
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_per_expert_and_fused_checkpoints_load_the_same(arch: str, tmp_path) -> None:
    from deepinfer.workers.loader import load_model

    per_expert = save_tiny_model(tmp_path / "per-expert", arch, num_hidden_layers=2)
    fused = tmp_path / "fused"
    shutil.copytree(per_expert, fused)
    (checkpoint,) = fused.glob("*.safetensors")
    tensors = load_file(checkpoint)
    assert any(".experts.0." in name for name in tensors), "save_pretrained wrote per expert"
    save_file(fuse_expert_tensors(tensors), checkpoint, metadata={"format": "pt"})
    a = load_model(str(per_expert), weight_copies="plain").state_dict()
    b = load_model(str(fused), weight_copies="plain").state_dict()
    assert a.keys() == b.keys()
    assert any(name.endswith("experts.gate_up_proj") for name in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
