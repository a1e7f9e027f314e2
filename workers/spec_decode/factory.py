"""Build the proposer the engine config asks for (None: no speculation)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.model_config import ModelConfigError
from workers.sample.sampler import Sampler
from workers.spec_decode.base import Draft, DraftRequest, Proposer, StepInput
from workers.spec_decode.ngram import NgramProposer


class NgramDrafter(Proposer):
    """Prompt lookup: no weights, deterministic drafts from the request's own tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lookup = NgramProposer(min_n, max_n)

    def propose(self, step: list[StepInput], requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup.propose(r.known_tokens(), r.max_drafts)) for r in requests]


def build_proposer(config: EngineConfig, sampler: Sampler) -> Proposer | None:
    method = config.speculative_method
    if method is None:
        return None
    if method == "ngram":
        return NgramDrafter(config.ngram_min, config.ngram_max)
    if method == "draft":
        from workers.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(
            config.speculative_model, config.resolved_model_dir(), config.dtype,
            config.kv_blocks(), config.block_size, config.host_kv_blocks(),
            config.cpu_linear_weights, sampler, kv_dtype=config.kv_dtype())
    if method == "mtp":
        from workers.spec_decode.mtp import MtpProposer

        return MtpProposer(config.resolved_model_dir(), config.dtype, config.kv_blocks(),
                           config.block_size, config.host_kv_blocks(), config.cpu_linear_weights,
                           sampler)
    raise ModelConfigError(f"unknown speculative method {method!r}")
