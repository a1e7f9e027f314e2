"""Build the proposer the engine config asks for (None: no speculation)."""

from __future__ import annotations

from torch import nn

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model_config import ModelConfigError
from deepinfer.workers.sample.sampler import Sampler
from deepinfer.workers.spec_decode.base import Proposer
from deepinfer.workers.spec_decode.ngram import NgramProposer


def build_proposer(config: EngineConfig, sampler: Sampler, target: nn.Module | None = None
                   ) -> Proposer | None:
    """`target`: the served model (proposers that read its layers or share its embedding and
    head: DeepSeek-V4's MTP layer, DSpark)."""
    method = config.speculative_method
    if method is None:
        return None
    if method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if method == "draft":
        from deepinfer.workers.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(
            config.speculative_model, config.resolved_model_dir(), config.dtype,
            config.kv_blocks(), config.block_size, config.cpu_linear_weights, sampler,
            kv_dtype=config.kv_dtype())
    if method == "mtp":
        from deepinfer.workers.spec_decode.mtp import MtpProposer

        if config.model_config().compressed is not None:  # DeepSeek-V4
            from deepinfer.workers.spec_decode.mtp_v4 import V4MtpProposer

            return V4MtpProposer(config.resolved_model_dir(), config.dtype, config.kv_blocks(),
                                 config.block_size, config.cpu_linear_weights, sampler, target)
        return MtpProposer(config.resolved_model_dir(), config.dtype, config.kv_blocks(),
                           config.block_size, config.cpu_linear_weights, sampler)
    if method == "dspark":
        from deepinfer.workers.spec_decode.dspark import DSparkProposer

        return DSparkProposer(config.speculative_model, config.resolved_model_dir(),
                              config.dtype, config.kv_blocks(), config.block_size, sampler,
                              target, config.speculative_confidence_threshold)
    raise ModelConfigError(f"unknown speculative method {method!r}")
