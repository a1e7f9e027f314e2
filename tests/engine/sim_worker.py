"""A simulated worker that records what every KV slot holds, to check the scheduler's plans.

It follows a StepPlan the way the real worker does (the KV connectors' work before the forward,
in the order workers/kv_connectors/base.py runs it, then every scheduled token's K/V written at
its slot, then attention reads, then the connectors' work after the forward) but stores, instead
of K/V tensors, the identity of what was computed there: a hash of the request's tokens from
position 0 through that position (a causal model's K/V at p depends on exactly those). Every
key a query reads must hold the identity of the querying request's own prefix at that key's
position;
anything else (a stale block, a block another request overwrote, a host block recycled too
early) is a wrong answer the real engine would have given silently.

A seq with draft slots speculates as the real worker does: it proposes 0..k random drafts,
writes their K/V (the identity of the draft path) and checks their queries, then accepts a
random prefix of them plus one token of its own. A rejected draft's slot holds K/V of tokens the
request never had: reading it later without rewriting it is caught like any other wrong slot.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from deepinfer.engine.model_config import FULL, SLIDING
from deepinfer.engine.protocol import (
    DiskTierWork,
    HostTierCopies,
    KVTransferDone,
    StepPlan,
    StepResult,
    pack_ids,
    unpack_ids,
)
from deepinfer.workers.kv_connectors.base import WorkerConnector, before_forward

CORRUPT = -1  # a slot whose contents are undefined (e.g. two copies raced into it)


@dataclass
class _Seq:
    tokens: list[int]  # prompt, then every token this worker sampled
    prefix_ids: list[int] = field(default_factory=list)  # identity of tokens[: p + 1]

    def identity(self, pos: int, drafts: list[int] = ()) -> int:
        """Identity of tokens[:pos + 1], the known tokens continued by `drafts`."""
        known = len(self.tokens)
        while len(self.prefix_ids) <= min(pos, known - 1):
            p = len(self.prefix_ids)
            prev = self.prefix_ids[-1] if self.prefix_ids else 0
            self.prefix_ids.append(hash((prev, self.tokens[p])))
        if pos < known:
            return self.prefix_ids[pos]
        value = self.prefix_ids[-1]
        for token in drafts[: pos - known + 1]:
            value = hash((value, token))
        return value


class SlotError(AssertionError):
    pass


class SimulatedWorker:
    def __init__(self, groups: list[str], block_size: int, window: int | None,
                 sample: random.Random, vocab: list[int]) -> None:
        self.groups = groups
        self.block_size = block_size
        self.window = window
        self.sample = sample
        self.vocab = vocab
        self.device: list[dict[int, int]] = [{} for _ in groups]  # slot -> identity
        # The KV connectors' halves, run in the real worker's order (workers/kv_connectors).
        self.host = SimHostTier(self)
        self.disk = SimDiskTier(self)
        self.connectors: list[WorkerConnector] = [self.host, self.disk]
        self.seqs: dict[str, _Seq] = {}
        self.slots_checked = 0

    # ------------------------------------------------------------------ one step

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished:
            self.seqs.pop(rid, None)
        for new in plan.new_requests:
            self.seqs[new.request_id] = _Seq(unpack_ids(new.prompt_ids).tolist())
        before_forward(self.connectors, plan.connectors)
        sampled: list[int] = []
        counts: list[int] = []
        proposed: list[int] = []
        for seq in plan.seqs:
            drafts = [self.sample.choice(self.vocab)
                      for _ in range(self.sample.randint(0, seq.draft_slots))]
            end = self._run_seq(seq, drafts)
            if seq.sample:
                state = self.seqs[seq.request_id]
                if end != len(state.tokens):
                    raise SlotError(f"{seq.request_id}: sampled before its last token")
                new = drafts[: self.sample.randint(0, len(drafts))]
                new.append(self.sample.choice(self.vocab))
                state.tokens += new
                sampled += new
                counts.append(len(new))
                proposed.append(len(drafts))
        for connector in self.connectors:
            entry = plan.connectors.get(connector.name)
            if entry is not None:
                connector.after_forward(entry)
        speculated = any(seq.draft_slots for seq in plan.seqs)
        return StepResult(plan.step_id, pack_ids(sampled),
                          num_sampled=pack_ids(counts) if speculated else b"",
                          num_drafts=pack_ids(proposed) if speculated else b"")

    def _run_seq(self, seq, drafts: list[int]) -> int:
        """Write the seq's K/V (drafts after its input), check every key its queries read;
        returns the end of its input."""
        state = self.seqs[seq.request_id]
        ids = unpack_ids(seq.token_ids).tolist()
        if not ids:  # overlap placeholder: the token this worker sampled last
            ids = [state.tokens[-1]]
        n = len(ids)
        if state.tokens[seq.start_pos: seq.start_pos + n] != ids:
            raise SlotError(f"{seq.request_id}: plan tokens differ from the request's tokens")
        if drafts and seq.start_pos + n != len(state.tokens):
            raise SlotError(f"{seq.request_id}: drafts before the request's last token")
        positions = range(seq.start_pos, seq.start_pos + n + len(drafts))
        for g, (kind, packed) in enumerate(zip(self.groups, seq.block_tables)):
            table = unpack_ids(packed)
            sliding = kind == SLIDING
            for p in positions:
                if sliding or p >= seq.full_kv_from:
                    slot = self._slot(table, p, seq.request_id)
                    self.device[g][slot] = state.identity(p, drafts)
            for q in positions:
                lo = 0
                if sliding:
                    lo = max(seq.window_from, q - self.window + 1)
                    if q >= seq.full_kv_from and seq.window_from > max(0, q - self.window + 1):
                        raise SlotError(f"{seq.request_id}: query at {q}, past the prefix hit, "
                                        "sees a window cut short by the replay start")
                for key in range(lo, q + 1):
                    self._check(g, table, key, state, seq.request_id, q, drafts)
        return seq.start_pos + n

    def _slot(self, table: np.ndarray, pos: int, rid: str) -> int:
        j = pos // self.block_size
        if j >= len(table) or table[j] < 0:
            raise SlotError(f"{rid}: position {pos} has no block (table {table.tolist()})")
        return int(table[j]) * self.block_size + pos % self.block_size

    def _check(self, g: int, table, key: int, state: _Seq, rid: str, q: int,
               drafts: list[int]) -> None:
        held = self.device[g].get(self._slot(table, key, rid))
        if held != state.identity(key, drafts):
            what = "nothing" if held is None else ("garbage" if held == CORRUPT else "another KV")
            raise SlotError(f"{rid}: query at {q} reads key {key} of group {self.groups[g]} "
                            f"holding {what}")
        self.slots_checked += 1


class SimHostTier(WorkerConnector):
    """The host tier's copies (workers/kv_connectors/host_tier.py) over slot identities."""

    name = "host_tier"

    def __init__(self, worker: SimulatedWorker) -> None:
        self.worker = worker
        self.slots: dict[int, int] = {}  # host slot -> identity (full-attention group)

    def save(self, entry: HostTierCopies) -> None:
        w, bs = self.worker, self.worker.block_size
        device = w.device[w.groups.index(FULL)]
        out = unpack_ids(entry.saves).reshape(-1, 2).tolist()
        # The real worker copies all pairs in one indexed copy: a target written twice in one
        # plan holds either source, so treat it as undefined.
        targets = [h for _, h in out]
        for dev, host in out:
            for o in range(bs):
                value = device.get(dev * bs + o)
                twice = targets.count(host) > 1
                self.slots[host * bs + o] = CORRUPT if twice or value is None else value

    def before_forward(self, entry: HostTierCopies) -> None:
        w, bs = self.worker, self.worker.block_size
        device = w.device[w.groups.index(FULL)]
        for host, dev in unpack_ids(entry.loads).reshape(-1, 2).tolist():
            for o in range(bs):
                device[dev * bs + o] = self.slots.get(host * bs + o, CORRUPT)


class SimDiskTier(WorkerConnector):
    """The disk tier's worker half (workers/kv_connectors/disk_tier.py) over slot identities:
    a save copies a block's identities under its digest (what the writer would put in its file),
    a load lands at once (the loader thread's earliest) and reports when `reports` is drained."""

    name = "disk_tier"

    def __init__(self, worker: SimulatedWorker) -> None:
        self.worker = worker
        self.files: dict[bytes, list[int]] = {}  # digest -> what its file holds, slot by slot
        self.reports: list[KVTransferDone] = []

    def _gather(self, group: str, blocks: bytes) -> list[int]:
        w, bs = self.worker, self.worker.block_size
        device = w.device[w.groups.index(group)]
        return [device.get(b * bs + o, CORRUPT) for b in unpack_ids(blocks).tolist()
                for o in range(bs)]

    def _save(self, blocks: bytes, digests: bytes) -> None:
        bs = self.worker.block_size
        values = self._gather(FULL, blocks)
        for i in range(len(digests) // 32):
            self.files[digests[i * 32:(i + 1) * 32]] = values[i * bs:(i + 1) * bs]

    def save(self, entry: DiskTierWork) -> None:
        self._save(entry.saves_now, entry.save_now_digests)

    def before_forward(self, entry: DiskTierWork) -> None:
        for i in range(0, len(entry.deletes), 32):
            self.files.pop(entry.deletes[i:i + 32], None)
        w, bs = self.worker, self.worker.block_size
        for load in entry.loads:
            targets = [(FULL, b) for b in unpack_ids(load.blocks).tolist()]
            names = [load.digests[i:i + 32] for i in range(0, len(load.digests), 32)]
            window = unpack_ids(load.window_blocks).tolist()
            good, error = 0, None
            for (group, block), name in zip(targets, names):
                held = self.files.get(name)
                if held is None:
                    error = "gone"
                    break
                device = w.device[w.groups.index(group)]
                for o in range(bs):
                    device[block * bs + o] = held[o]
                good += 1
            if window and error is None:
                held = self.files.get(load.window_digest)
                if held is None:
                    error = "gone"
                else:
                    device = w.device[w.groups.index(SLIDING)]
                    for j, block in enumerate(window):
                        for o in range(bs):
                            device[block * bs + o] = held[j * bs + o]
            self.reports.append(KVTransferDone(load.request_id, 0, blocks=good, error=error))

    def after_forward(self, entry: DiskTierWork) -> None:
        self._save(entry.saves, entry.save_digests)
        for save in entry.window_saves:
            self.files[save.digest] = self._gather(SLIDING, save.blocks)
