"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), attached to
a loaded model's linears, and the low-rank products they add in a mixed batch.

An adapter changes a linear W into W + scale * B A (A: [r, in], B: [out, r]; each module's scale
as PEFT computes it, workers/lora/peft_files.py). Each attached adapter has a slot; each
linear an adapter targets keeps every slot's A and B stacked (`SlotStacks`: ranks zero-padded to
the largest rank the linear has held, a fused q|k|v or gate|up linear's parts side by side),
so one call per linear
adds every row's own product: the grouped shrink (x A^T) and expand (B^T, scale folded in) of
kernels/cpu/lora.py (a native kernel) or kernels/triton/lora.py (CUDA). Which slot each row of a
step uses is `CURRENT` (set by the runner around the forward); a linear no adapter targets runs
untouched, as does every row of the base model (slot -1).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deepinfer.kernels.cpu import lora as cpu_lora
from deepinfer.workers.distributed.parallel_state import tp
from deepinfer.workers.layers.linear import Linear, MergedLinear, RowParallelLinear
from deepinfer.workers.lora.peft_files import AdapterFiles, LoRAError

__all__ = ["CURRENT", "LoRAError", "attach", "detach", "step_adapters", "step_slots"]


class StepSlots(threading.local):
    """The step's adapter slot per row (int32 [rows], -1: the base model), set around each
    forward by the runner; None: no row uses an adapter."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


CURRENT = StepSlots()


def step_adapters(batch) -> set[str]:
    """The adapters a step (workers/step_batch.py StepBatch) uses."""
    return {r.state.params.lora for r in batch.rows if r.state.params.lora is not None}


def step_slots(batch, slot_of: dict[str, int], device: torch.device) -> None:
    """Set CURRENT for a step from each adapter's slot (None when no row uses one; an adapter
    without a slot, one that could not be attached: -1, the base model)."""
    slots = None
    for r in batch.rows:
        adapter = r.state.params.lora
        if adapter is not None:
            if slots is None:
                slots = torch.full((len(batch.input_ids),), -1, dtype=torch.int32)
            slots[r.first_row:r.first_row + r.num_rows] = slot_of.get(adapter, -1)
    CURRENT.slots = None if slots is None else slots.to(device)


@dataclass
class _Product:
    linear: Linear
    part: int  # which of the linear's parts (0 for an unfused linear)
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [size, r], scale folded in


def attach(model: nn.Module, slot: int, path: str | Path, adapter: AdapterFiles) -> None:
    """Put `adapter` (read from `path`) into `slot` of `model`'s linears (whatever the slot
    held is cleared); raises LoRAError (nothing changes then)."""
    modules = dict(model.named_modules())
    plan: list[_Product] = []
    for module_path, (a, b) in adapter.products.items():
        for old, new in model.checkpoint_renames.items():
            module_path = module_path.replace(old, new)
        leaf = module_path.rpartition(".")[2]
        part = None
        if leaf in model.stacked_params:
            fused, part = model.stacked_params[leaf]
            module_path = module_path[: -len(leaf)] + fused
        linear = modules.get(module_path)
        if not isinstance(linear, Linear):
            raise LoRAError(f"{path}: the model has no {module_path} (an adapter of another "
                            "base model?)")
        parts = _parts(linear)
        index = list(parts).index(part) if part in parts else 0
        size = parts[part][1] if part in parts else linear.out_features
        if tp().world > 1:  # this rank's share, checked as the unsharded tensors were
            a, b = _shard(linear, part, a, b)
        if a.shape[1] != linear.in_features or b.shape[0] != size or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{path}: {module_path}{'.' + part if part else ''} has A "
                            f"{tuple(a.shape)} and B {tuple(b.shape)}, the model's linear "
                            f"takes {linear.in_features} -> {size} (another base model?)")
        plan.append(_Product(linear, index, a, b))
    detach(model, slot)
    for p in plan:
        _stacks(p.linear).put(slot, p.part, p.a, p.b)
    # Every linear with adapters holds as many slots: a step's slots index them all.
    every = [m.lora_stacks for m in model.modules() if hasattr(m, "lora_stacks")]
    count = max(s.a.shape[0] for s in every)
    for stacks in every:
        stacks.reserve(count)


def detach(model: nn.Module, slot: int) -> None:
    """Clear `slot` in every linear (its rows then add nothing until it is attached again)."""
    for module in model.modules():
        stacks = getattr(module, "lora_stacks", None)
        if stacks is not None:
            stacks.clear(slot)


def _shard(linear: Linear, part: str | None, a: torch.Tensor, b: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A product's share on this tensor-parallel rank, as its linear's weight is split: B's rows
    of a column-parallel part; A's columns of a row-parallel linear (whose partial products,
    the adapter's among them, one all-reduce sums)."""
    if isinstance(linear, MergedLinear) and part is not None:
        b = linear.part_rows(part, b)
    elif isinstance(linear, RowParallelLinear):
        a = linear.weight.load(a)
    return a, b


def _parts(linear: Linear) -> dict[str | None, tuple[int, int]]:
    """The linear's output parts in order: (offset, size) each."""
    if isinstance(linear, MergedLinear):
        return dict(linear.parts)
    return {None: (0, linear.out_features)}


def _dtype(linear: Linear) -> torch.dtype:
    return linear.bias.dtype if linear.bias is not None else (
        linear.weight.dtype if linear.weight.numel() else torch.float32)


class SlotStacks:
    """One linear's adapters, by slot: a [S, P*R, in] (the parts' A side by side) and per part
    b [S, size, R]; grown as slots are used, and R as a larger rank arrives (padding every
    adapter to --max-lora-rank would cost its memory and time for nothing)."""

    def __init__(self, linear: Linear) -> None:
        self.rank = 0
        self.offsets = [off for off, _ in _parts(linear).values()]
        self.sizes = [size for _, size in _parts(linear).values()]
        self.in_features = linear.in_features
        self.device, self.dtype = linear.weight.device, _dtype(linear)
        self.a = self._zeros(0, 0, self.in_features)
        self.bs = [self._zeros(0, size, 0) for size in self.sizes]
        self.used: set[int] = set()  # slots with a product here

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def reserve(self, count: int) -> None:
        """Room for `count` slots (the new ones hold nothing)."""
        grow = count - self.a.shape[0]
        if grow > 0:
            self.a = torch.cat([self.a, self._zeros(grow, *self.a.shape[1:])])
            self.bs = [torch.cat([b, self._zeros(grow, *b.shape[1:])]) for b in self.bs]

    def _widen(self, rank: int) -> None:
        """Room for products of `rank` (the stacks' ranks zero-padded to it)."""
        count, parts = self.a.shape[0], len(self.sizes)
        a = self._zeros(count, parts * rank, self.in_features)
        for p in range(parts):
            a[:, p * rank:p * rank + self.rank] = self.a[:, p * self.rank:(p + 1) * self.rank]
        self.a = a
        self.bs = [torch.cat([b, self._zeros(count, b.shape[1], rank - self.rank)], 2)
                   for b in self.bs]
        self.rank = rank

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if slot >= self.a.shape[0]:  # room for this slot, and as many again
            self.reserve(max(slot + 1, 2 * self.a.shape[0]))
        r = a.shape[0]
        if r > self.rank:
            self._widen(r)
        rows = slice(part * self.rank, part * self.rank + r)
        self.a[slot, rows] = a.to(self.device, self.dtype)
        self.bs[part][slot, :, :r] = b.to(self.device, self.dtype)
        self.used.add(slot)

    def clear(self, slot: int) -> None:
        if slot in self.used:
            self.a[slot].zero_()
            for b in self.bs:
                b[slot].zero_()
            self.used.discard(slot)

    def add_products(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """y += each row's adapter product, in place (rows past the stacks' slots: none)."""
        if not self.used:
            return
        x = x.reshape(-1, self.in_features)
        if x.device.type == "cuda":
            from deepinfer.kernels.triton.lora import lora_delta_ as triton_lora_delta_

            triton_lora_delta_(y, x.contiguous(), slots, self.a, self.bs, self.offsets)
        else:
            cpu_lora.lora_delta_(y, x.contiguous(), slots, self.a, self.bs, self.offsets)


def _stacks(linear: Linear) -> SlotStacks:
    """The linear's SlotStacks, its forward wrapped the first time."""
    if not hasattr(linear, "lora_stacks"):
        linear.lora_stacks = SlotStacks(linear)
        base = linear.forward
        # Split over tensor-parallel ranks by input: the products join the partial sums.
        reduce = isinstance(linear, RowParallelLinear) and linear.tp.world > 1

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = Linear.forward(linear, x) if reduce else base(x)
            if CURRENT.slots is not None:
                linear.lora_stacks.add_products(y, x, CURRENT.slots)
            return linear.tp.all_reduce(y) if reduce else y

        linear.forward = forward
    return linear.lora_stacks
