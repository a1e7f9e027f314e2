"""A simulated worker that records what every KV slot holds, to check the scheduler's plans.

It follows a StepPlan the way the real worker does (host-tier copies first, then every
scheduled token's K/V written at its slot, then attention reads) but stores, instead of K/V
tensors, the identity of what was computed there: a hash of the request's tokens from position 0
through that position (a causal model's K/V at p depends on exactly those). Every key a query
reads must hold the identity of the querying request's own prefix at that key's position;
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
from deepinfer.engine.protocol import StepPlan, StepResult, pack_ids, unpack_ids

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
        self.host: dict[int, int] = {}  # host slot -> identity (full-attention group)
        self.seqs: dict[str, _Seq] = {}
        self.slots_checked = 0

    # ------------------------------------------------------------------ one step

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished:
            self.seqs.pop(rid, None)
        for new in plan.new_requests:
            self.seqs[new.request_id] = _Seq(unpack_ids(new.prompt_ids).tolist())
        self._copy_blocks(plan)
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
        speculated = any(seq.draft_slots for seq in plan.seqs)
        return StepResult(plan.step_id, pack_ids(sampled),
                          num_sampled=pack_ids(counts) if speculated else b"",
                          num_drafts=pack_ids(proposed) if speculated else b"")

    def _copy_blocks(self, plan: StepPlan) -> None:
        copies = plan.connectors.get("host_tier")  # the host tier's saves and loads
        if copies is None:
            return
        full = self.groups.index(FULL)
        bs = self.block_size
        out = unpack_ids(copies.saves).reshape(-1, 2).tolist()
        into = unpack_ids(copies.loads).reshape(-1, 2).tolist()
        # The real worker copies all pairs in one indexed copy: a target written twice in one
        # plan holds either source, so treat it as undefined.
        targets = [h for _, h in out]
        for dev, host in out:
            for o in range(bs):
                value = self.device[full].get(dev * bs + o)
                twice = targets.count(host) > 1
                self.host[host * bs + o] = CORRUPT if twice or value is None else value
        for host, dev in into:
            for o in range(bs):
                self.device[full][dev * bs + o] = self.host.get(host * bs + o, CORRUPT)

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
