"""workers/deterministic.py: what it switches on a loaded model, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer.engine.model_config import ModelConfigError
from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.kernels.cpu import linear as cpu_linear
from deepinfer.workers.attention.cpu_backend import CpuAttention
from deepinfer.workers.attention.torch_backend import TorchAttention
from deepinfer.workers.deterministic import WEIGHT_COPIES, make_row_invariant
from deepinfer.workers.layers.linear import Linear, PlainWeight

if not (cpu_linear.available(torch.zeros(1)) and cpu_attention.available(torch.zeros(1))):
    pytest.skip("native CPU kernels unavailable", allow_module_level=True)


def linear(quantization: str | None = None) -> Linear:
    torch.manual_seed(0)
    lin = Linear(64, 48)
    lin.weight.data.normal_()
    lin.finalize(WEIGHT_COPIES, quantization)
    return lin


@pytest.fixture()
def backend():
    b = CpuAttention()
    yield b
    cpu_attention.set_fixed_split(0)  # process-wide: the other tests want the default


def test_every_row_count_takes_the_small_m_kernel(backend):
    lin = linear()
    make_row_invariant(nn.Sequential(lin), backend)
    assert lin.row_invariant and backend.row_invariant
    x = torch.randn(9, 64)
    assert torch.equal(lin(x), cpu_linear.linear_small_m(x, lin.weight.data))
    assert torch.equal(lin(x)[3:4], lin(x[3:4]))


def test_quantized_weights_and_other_backends_are_refused(backend):
    with pytest.raises(ModelConfigError, match="1 linears are not"):
        make_row_invariant(nn.Sequential(linear("int8")), backend)
    with pytest.raises(ModelConfigError, match="torch attention backend"):
        make_row_invariant(nn.Sequential(linear()), TorchAttention())


def test_models_with_matmuls_outside_linears_are_refused(backend):
    with pytest.raises(ModelConfigError, match="PlainWeight"):
        make_row_invariant(nn.Sequential(linear(), PlainWeight(8, 8)), backend)
