"""--deterministic: a request's tokens and logprobs are bit-identical whatever shares its batch,
however its prompt is chunked, and wherever its prefix's KV came from.

A float32 sum depends on its order, and the fast paths pick their order by the batch: oneDNN's
GEMM blocks by M, the paged attention kernel splits rows by the batch's total length, and a
prompt chunk's SDPA reduces over however many keys the chunk has. Row-invariant mode takes, for
every row, one order fixed by the row alone:

- linear: the small-M weight-streaming kernel at every row count (kernels/cpu/csrc/linear.cpp:
  each output is one FMA chain over K in fixed vector steps, then one fixed horizontal sum,
  whatever M is); only the plain weight copy is kept (the packed one would never be read);
- attention: every token, prompt chunks included, is a row of the paged kernel, which reads its
  keys from the cache in runs of a fixed number of blocks from its first key, combined in order
  (kernels/cpu/attention.py set_fixed_split): a query at position p sums exactly the same way
  in a chunk, in a decode, after a prefix hit from any tier, or beside 63 other requests;
- on a GPU (workers/attention/triton_backend.py): linears through a fixed-tile Triton matmul
  (kernels/triton/matmul.py) instead of cuBLAS, decode attention for every token in splits of a
  fixed number of keys merged in order (kernels/triton/decode_attention.py keys_per_split);
- norms, rotary, silu·up: the native ops and the Triton kernels already compute each row
  alone; sampling (on the host) reduces each row alone (log_softmax, softmax, cumsum, argmax
  over the vocabulary), and seeded draws are u(seed, k) (workers/sample/sampler.py): unseeded
  sampling draws from the engine's generator in batch order, so only greedy and seeded
  requests are reproducible.

Every step is then "all decode rows", so on the CPU a Llama-family model runs each step through
its one-call native decode stack, the linears on the small-M kernel throughout. What it costs:
prefill chunks lose the GEMM (the small-M kernel streams weights; it is far from a GEMM's peak at
hundreds of rows) and attention over a chunk becomes one kernel row per token.
"""

from __future__ import annotations

from torch import nn

from deepinfer.engine.model_config import ModelConfigError
from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.workers.attention import AttentionBackend
from deepinfer.workers.layers.linear import Linear, PlainWeight
from deepinfer.workers.layers.moe import FusedExperts

WEIGHT_COPIES = "plain"  # the only copy the row-invariant linear reads


def make_row_invariant(model: nn.Module, backend: AttentionBackend) -> None:
    """Switch a loaded model (loaded with WEIGHT_COPIES) to row-invariant kernels; raises
    ModelConfigError where this device or model has none."""
    from deepinfer.workers.attention.cpu_backend import CpuAttention
    from deepinfer.workers.attention.triton_backend import TritonAttention

    if not isinstance(backend, (CpuAttention, TritonAttention)):
        raise ModelConfigError(
            "--deterministic runs on the CPU's native float32 kernels or the Triton kernels of "
            f"a GPU; the {backend.name} attention backend has no row-invariant mode")
    other = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, (FusedExperts, PlainWeight))})
    if other:  # matmuls outside Linear (experts, MLA's absorbed projections): not covered
        raise ModelConfigError(
            "--deterministic covers dense models whose matmuls are all linears (Llama, Qwen, "
            f"Mistral, Gemma 3); this one has {', '.join(other)}")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    quantized = [name for name, m in linears if m.quant is not None]
    on_cpu = isinstance(backend, CpuAttention)
    slow = [name for name, m in linears if on_cpu and m.quant is None and not m.small_m]
    if quantized or slow:
        bad = quantized + slow
        raise ModelConfigError(
            "--deterministic needs float32 weights the native small-M kernel takes, or a GPU's "
            f"unquantized ones; {len(bad)} linears are not, e.g. {', '.join(bad[:3])}")
    if on_cpu:
        cpu_attention.set_fixed_split(cpu_attention.FIXED_SPLIT_BLOCKS)
    backend.row_invariant = True
    for _, m in linears:
        m.row_invariant = True
    for m in model.modules():
        if getattr(m, "fast_stack", None) is not None:
            # Its linears have no packed copy: the small-M kernel at every row count.
            m.fast_any_rows = True
