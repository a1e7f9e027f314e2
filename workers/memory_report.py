"""What a worker's model holds in memory, reported once at start: the weights as served (and how
much of them is a view of the model file's pages, shared with the page cache), the second copies
kept for speed (oneDNN-packed float weights, the integer GEMM's tiles, FBGEMM's), the KV cache,
and the process's resident memory."""

from __future__ import annotations

import resource

import torch
from torch import nn

MIB = 2**20


def _bytes(t: torch.Tensor | None) -> int:
    if t is None or t.is_mkldnn:
        return 0 if t is None else t.numel() * t.element_size()
    return t.untyped_storage().nbytes() if t.numel() else 0


def model_memory(model: nn.Module) -> dict[str, int]:
    """Bytes by kind: weights (parameters and quantized weights, each storage once), mapped (of
    those, views of a mapped file), copies (second copies)."""
    seen: set[int] = set()
    out = {"weights": 0, "mapped": 0, "copies": 0}
    ranges = _file_mappings()

    def weight(t: torch.Tensor | None, mapped: bool = False) -> None:
        if t is None or not t.numel() or t.is_mkldnn:
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        out["weights"] += _bytes(t)
        if mapped:
            out["mapped"] += _bytes(t)

    for p in model.parameters():
        weight(p.data)
    for m in model.modules():
        quantized = getattr(m, "quantized", None)  # a quantized embedding
        if quantized is not None and hasattr(quantized, "qweight"):
            for t in (quantized.qweight, quantized.scales, quantized.mins):
                weight(t, mapped=t is quantized.qweight and _is_mapped(t, ranges))
        quant = getattr(m, "quant", None)
        for q in getattr(quant, "parts", None) or ([quant] if quant is not None else []):
            if not hasattr(q, "weight"):
                continue
            w = q.weight
            for t in (w.qweight, w.scales, w.mins):
                weight(t, mapped=t is w.qweight and _is_mapped(t, ranges))
            out["copies"] += q.nbytes() - w.nbytes()
        packed = getattr(m, "packed", None)
        if isinstance(packed, torch.Tensor):
            out["copies"] += packed.numel() * packed.element_size()
    return out


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed mappings (/proc/self/maps)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return ranges


def _is_mapped(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """A tensor over a mapped file (workers/quantization/gguf.py's K-quants)."""
    p = t.data_ptr()
    return any(lo <= p < hi for lo, hi in ranges)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_line(model: nn.Module, kv_caches) -> str:
    """One log line: weights (mapped), second copies, KV cache, this process's peak RSS."""
    mem = model_memory(model)
    kv = sum(_bytes(k) + _bytes(v) for k, v in kv_caches)
    return (f"memory: weights {mem['weights'] / MIB:.0f} MiB ({mem['mapped'] / MIB:.0f} MiB "
            f"mapped from the model file), second copies {mem['copies'] / MIB:.0f} MiB, KV cache "
            f"{kv / MIB:.0f} MiB, process peak RSS {peak_rss_bytes() / MIB:.0f} MiB")
