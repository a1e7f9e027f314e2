"""Mixture-of-experts building blocks: top-k routing, and all experts of a layer run fused.

The experts' weights are stacked, [E, 2I, H] (gate | up) and [E, H, I] (down), the layout HF
transformers keeps in memory. A step's (token, expert) pairs are sorted by expert so each
active expert runs one GEMM over its contiguous rows, whatever mix of prefill chunks and
decodes the step holds; the weighted results are summed back per token with one index_add_.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.cpu import fused as cpu_fused
from deepinfer.kernels.cpu import linear as cpu_linear
from deepinfer.workers.distributed.parallel_state import ep, group, tp
from deepinfer.workers.layers.checkpoint_tensor import materialize
from deepinfer.workers.layers.linear import SMALL_M


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]): softmax
    over all experts in float32, the top k, optionally rescaled to sum to 1 (Mixtral always,
    Qwen MoE when `norm_topk_prob`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_grouped(logits: torch.Tensor, correction: torch.Tensor, top_k: int, n_group: int,
                  topk_group: int, renormalize: bool, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores; experts are chosen by score + correction bias,
    only within the `topk_group` groups whose two best biased scores sum highest; their
    weights are the unbiased scores (renormalized to sum to 1 when asked), times `scaling`."""
    scores = torch.sigmoid(logits.float())
    choice = scores + correction.float()
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    group_scores = grouped.topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return (weights * scaling).to(logits.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4's experts)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, native: bool,
            limit: float | None = None) -> torch.Tensor:
    """One expert's SwiGLU MLP over its rows; the weight-streaming kernel for decode-sized
    row counts, a GEMM above."""
    if limit:
        return F.linear(clamped_swiglu(F.linear(x, gate_up), limit), down)
    if native and x.shape[0] <= SMALL_M:
        return cpu_linear.linear_small_m(
            cpu_fused.silu_and_mul(cpu_linear.linear_small_m(x, gate_up)), down)
    h = F.linear(x, gate_up)
    h = cpu_fused.silu_and_mul(h) if native else cpu_fused.silu_and_mul_ref(h)
    return F.linear(h, down)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, native: bool = False,
                  limit: float | None = None, first: int = 0) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], gate_up [E, 2I, H],
    down [E, H, I], weights / ids [T, k]. `native`: the CPU float32 kernels take the weights;
    `limit`: the clamped SwiGLU; `first`: the global id of gate_up's expert 0 (expert
    parallelism: pairs routed to experts held elsewhere count 0 here)."""
    k = ids.shape[1]
    local = ids.reshape(-1) - first
    pairs = ((local >= 0) & (local < gate_up.shape[0])).nonzero().squeeze(1)
    local = local[pairs]
    order = torch.argsort(local, stable=True)  # (token, slot) pairs grouped by expert
    pairs = pairs[order]
    tokens = pairs // k
    counts = torch.bincount(local, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, tokens)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = _expert(xs[start:start + n], gate_up[e], down[e], native,
                                          limit)
            start += n
    ys.mul_(weights.reshape(-1)[pairs].unsqueeze(1).to(ys.dtype))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


class FusedExperts(nn.Module):
    """A layer's experts; checkpoints fill them whole (HF's fused 3D tensors, by name) or one
    expert's projection at a time (`load_expert`).

    Over several ranks they are split one of two ways (workers/distributed/parallel_state.py):
    expert parallelism gives each rank whole experts, tensor parallelism gives each rank a slice
    of every expert's intermediate size; either way each rank loads only its part and one
    all-reduce sums the ranks' outputs."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        experts, slices = ep(), tp()
        self.group = group() if experts.world * slices.world > 1 else None
        self.first, num_local = experts.shard(num_experts, "experts")
        self.full_intermediate = intermediate
        self.inter_start, intermediate = slices.shard(intermediate, "expert intermediate size")
        self.intermediate = intermediate
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, intermediate),
                                      requires_grad=False)
        # Fused [E, ...] checkpoint tensors: the loader keeps this rank's part.
        self.gate_up_proj.load = self._gate_up_part
        self.down_proj.load = lambda t: self._experts_part(t).narrow(
            2, self.inter_start, self.intermediate)
        self._native = False  # set by finalize()

    def _experts_part(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, self.first, self.gate_up_proj.shape[0])

    def _gate_up_part(self, t: torch.Tensor) -> torch.Tensor:
        t, start, n = self._experts_part(t), self.inter_start, self.intermediate
        up = self.full_intermediate + start  # [gate | up] rows of the full tensor
        return torch.cat([materialize(t.narrow(1, start, n)), materialize(t.narrow(1, up, n))],
                         dim=1)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> str:
        """Copy one expert's "gate", "up" or "down" weight in (nothing when another rank holds
        that expert); returns the parameter's name."""
        i = self.intermediate
        name = "down_proj" if part == "down" else "gate_up_proj"
        local = expert - self.first
        if not 0 <= local < self.gate_up_proj.shape[0]:
            return name
        target = getattr(self, name).data[local]
        if part == "down":
            tensor = tensor.narrow(1, self.inter_start, i)
        else:
            target = target[{"gate": slice(0, i), "up": slice(i, 2 * i)}[part]]
            tensor = tensor.narrow(0, self.inter_start, i)
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert} {part}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= {tuple(target.shape)}")
        target.copy_(materialize(tensor))
        return name

    def finalize(self) -> None:
        w = self.gate_up_proj.data
        self._native = cpu_linear.available(w) and cpu_fused.available(w)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        out = fused_experts(x, self.gate_up_proj.data, self.down_proj.data, weights, ids,
                            self._native, self.swiglu_limit, self.first)
        return out if self.group is None else self.group.all_reduce(out)
