"""Grammar bitmask applied to logits rows: disallowed tokens get -inf, in place.

The bitmask is xgrammar's layout (workers/structured): int32 words [num_rows, ceil(V / 32)],
bit j of word w set when token 32 * w + j is allowed. Only the listed rows are touched (a step
constrains some requests and not others), and only the first min(V, 32 * words) columns, as
xgrammar's own apply does. One program per (listed row, column block): no host sync, no
expanded boolean mask in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_token_bitmask", "apply_token_bitmask_ref"]


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, logits_stride, mask_stride, vocab,
                    BLOCK: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(mask_ptr + row * mask_stride + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + tokens, minus_inf, mask=in_vocab & ~allowed)


def _rows_tensor(rows: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows.to(device=device, dtype=torch.int32)
    return torch.tensor(rows, dtype=torch.int32, device=device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int] | torch.Tensor, block: int = 1024) -> None:
    """logits [R, V] (last dim contiguous), bitmask int32 [R, W]; `rows`: the rows to mask."""
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    rows_t = _rows_tensor(rows, logits.device)
    if rows_t.numel() and vocab:
        block = min(block, triton.next_power_of_2(vocab))
        grid = (rows_t.numel(), triton.cdiv(vocab, block))
        _bitmask_kernel[grid](logits, bitmask, rows_t, logits.stride(0), bitmask.stride(0),
                              vocab, BLOCK=block)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: list[int] | torch.Tensor) -> None:
    """Plain torch: unpack the listed rows' bits, fill -inf where a bit is clear."""
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    idx = _rows_tensor(rows, logits.device).long()
    tokens = torch.arange(vocab, device=logits.device)
    bits = (bitmask[idx][:, tokens // 32] >> (tokens % 32)) & 1  # [n, vocab]
    logits[idx, :vocab] = logits[idx, :vocab].masked_fill(bits == 0, float("-inf"))
