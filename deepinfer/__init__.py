"""DeepInfer: an LLM inference engine and OpenAI-compatible server.

The one import package of the distribution. Its subpackages are the repository's top-level
folders, linked in (deepinfer/engine -> ../engine, ...): `deepinfer.engine` (protocol, config,
tokenizer and scheduler processes, launcher, offline API), `deepinfer.frontend` (HTTP server,
router, CLI, load generator), `deepinfer.workers` (model execution) and `deepinfer.kernels`
(native CPU and Triton kernels). The public Python API is here:

    from deepinfer import LLM, SamplingParams
"""

from __future__ import annotations

from deepinfer.engine.protocol import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: a process that only needs the protocol (a worker, the server) never loads the
    # offline runtime.
    if name == "LLM":
        from deepinfer.engine.runtime.llm import LLM

        return LLM
    raise AttributeError(name)
