"""Copy whole KV blocks between two pools (device cache <-> host tier), one indexed copy each."""

from __future__ import annotations

import torch

KVPair = tuple[torch.Tensor, torch.Tensor]


def copy_blocks(pairs: torch.Tensor, device: list[KVPair], host: list[KVPair],
                to_host: bool) -> None:
    """pairs [n, 2] int64: (device block, host block) when `to_host`, else (host, device).
    The scheduler never repeats a target block within one plan (engine/kvcache/host_tier.py):
    an indexed copy with repeated targets keeps either source."""
    for dev_kv, host_kv in zip(device, host):
        for dev, hst in zip(dev_kv, host_kv):
            src, dst = (dev, hst) if to_host else (hst, dev)
            # Each index where its tensor is; the gathered blocks cross once (a GPU cache and
            # its host tier), blocking, since the next statement reads them.
            rows = src.index_select(0, pairs[:, 0].to(src.device))
            dst.index_copy_(0, pairs[:, 1].to(dst.device), rows.to(dst.device))
