"""GGUF tensors read as they are stored (workers/quantization/gguf.py): every supported type's
QuantizedWeight dequantizes bit for bit to what gguf.dequantize gives, in HF layout.

Exact, not close: each layout does the same float32 operations as gguf's dequantizers (the
products d * sc, d * q, and q * d + m, with x - m computed as x + (-m), which IEEE makes equal).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as Q

from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.gguf_model import SERVED_TYPES
from deepinfer.engine.model_store.gguf_weights import hf_tensors, unpermute_heads
from deepinfer.workers.quantization import gguf as gguf_quant
from deepinfer.workers.quantization.gguf import gguf_weights, read_tensor
from deepinfer.workers.quantization.weight import QuantizedWeight
from tests.engine.model_store import tiny_gguf

ROWS, COLS = 8, 512  # two K-quant super-blocks per row
# type -> (QuantizedWeight kind, group size); None: read as a float32 tensor
LAYOUT = {Q.F32: None, Q.F16: None, Q.BF16: None, Q.Q8_0: ("int8", 32), Q.Q6_K: ("q6_k", 256),
          Q.Q4_0: ("q4", 32), Q.Q4_1: ("q4", 32), Q.Q4_K: ("q4_k", 256), Q.Q5_K: ("q5_k", 256)}
# Where a K-quant block keeps its fp16 factors (d, and dmin for Q4_K / Q5_K).
_FP16_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _k_quant_bytes(qtype: Q, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks (gguf cannot quantize K-quants) with finite fp16 factors, zero and a
    subnormal among them."""
    n, size = COLS // GGML_QUANT_SIZES[qtype][0], GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows, n, size), dtype=np.uint8)
    for offset in _FP16_OFFSETS[qtype]:
        d = rng.uniform(-0.05, 0.05, (rows, n, 1)).astype(np.float16)
        d[0, 0], d[1, 0] = 0.0, 6e-8
        raw[..., offset:offset + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def _stored(qtype: Q, rows: int, rng: np.random.Generator) -> np.ndarray:
    if qtype in _FP16_OFFSETS:
        return _k_quant_bytes(qtype, rows, rng)
    return gguf.quants.quantize(rng.standard_normal((rows, COLS), dtype=np.float32), qtype)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(str(path))


def _reference(t) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(t.shape))
    return gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def test_decoders_cover_the_served_types():
    served = gguf_quant._DECODERS.keys() | gguf_quant._FLOATS | gguf_quant._KQUANTS
    assert {t.name for t in served} == SERVED_TYPES
    assert {t.name for t in LAYOUT} == SERVED_TYPES


@pytest.mark.parametrize("qtype", list(LAYOUT), ids=lambda q: q.name)
def test_each_type_dequantizes_exactly_as_gguf(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    reader = _write(tmp_path / "t.gguf", {"w.weight": (_stored(qtype, ROWS, rng), qtype)})
    (t,) = reader.tensors
    w = read_tensor(t)
    expected = _reference(t)
    assert np.isfinite(expected).all()
    if LAYOUT[qtype] is None:
        assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
        np.testing.assert_array_equal(w.numpy(), expected)
        return
    assert isinstance(w, QuantizedWeight) and (w.kind, w.group_size) == LAYOUT[qtype]
    assert tuple(w.shape) == (ROWS, COLS)
    np.testing.assert_array_equal(w.dequantize().numpy(), expected)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K],
                         ids=lambda q: q.name)
def test_permuted_rows_move_with_their_scales_and_mins(tmp_path, qtype):
    rng = np.random.default_rng(1)
    reader = _write(tmp_path / "t.gguf", {"q.weight": (_stored(qtype, ROWS, rng), qtype)})
    (t,) = reader.tensors
    w = read_tensor(t, heads=2)
    np.testing.assert_array_equal(w.dequantize().numpy(), unpermute_heads(_reference(t), 2))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_stay_views_of_the_mapped_file(tmp_path, qtype):
    """Served as stored: the weight's bytes are the file's pages (no copy at load) when the
    file is mapped copy-on-write as gguf_weights maps it, so no write reaches the file."""
    rng = np.random.default_rng(3)
    path = tmp_path / "t.gguf"
    _write(path, {"w.weight": (_stored(qtype, ROWS, rng), qtype)})
    before = path.read_bytes()
    reader = GGUFReader(str(path), "c")  # as gguf_weights opens a file
    (t,) = reader.tensors
    w = read_tensor(t)
    assert w.ggml_type == int(qtype) and w.qweight.data_ptr() == t.data.ctypes.data
    np.testing.assert_array_equal(w.dequantize().numpy(), _reference(t))
    w.qweight[0, 0] ^= 0xFF  # a stray write stays in this process (copy-on-write)
    assert path.read_bytes() == before


def _all(kind: Q, norms: Q = Q.F32):
    return lambda name: norms if name.endswith("norm.weight") else kind


@pytest.mark.parametrize("qtype", [tiny_gguf._qtype, _all(Q.Q4_0), _all(Q.Q8_0, Q.F16),
                                   _all(Q.BF16, Q.BF16), _all(Q.Q4_1, Q.Q8_0)],
                         ids=["mixed", "q4_0", "q8_0", "bf16", "q4_1"])
def test_a_llama_file_matches_the_converter(tmp_path, qtype):
    """The same names, order and values as the dequantizing converter (Q/K un-permuted)."""
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, tied=False, qtype=qtype)
    reference = list(hf_tensors(GGUFReader(str(path)), "llama", tiny_gguf.HEADS,
                                tiny_gguf.KV_HEADS))
    ours = list(gguf_weights(str(path)))
    assert [name for name, _ in ours] == [name for name, _ in reference]
    for (name, w), (_, expected) in zip(ours, reference):
        is_matrix = expected.ndim == 2 and qtype(name) not in (Q.F32, Q.F16, Q.BF16)
        assert isinstance(w, QuantizedWeight) == is_matrix, name
        got = w.dequantize() if isinstance(w, QuantizedWeight) else w
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)


def test_gemma3_norms_lose_their_shift(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(32)
    writer.add_token_list(["a", "b"])
    rng = np.random.default_rng(2)
    writer.add_tensor("output_norm.weight", 1 + rng.standard_normal(64, dtype=np.float32))
    q = gguf.quants.quantize(rng.standard_normal((64, 64), dtype=np.float32), Q.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = dict(hf_tensors(GGUFReader(str(path)), "gemma3", 4, 1))
    ours = dict(gguf_weights(str(path)))
    np.testing.assert_array_equal(ours["model.norm.weight"].numpy(),
                                  reference["model.norm.weight"])
    q_proj = ours["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q_proj.dequantize().numpy(),
                                  reference["model.layers.0.self_attn.q_proj.weight"])


def test_an_unsupported_type_is_refused_by_name(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, qtype=lambda n: Q.Q5_0 if "q_proj" in n else Q.F32)
    with pytest.raises(ModelPrepareError, match=r"'blk\.0\.attn_q\.weight' is Q5_0.*Q5_K"):
        list(gguf_weights(str(path)))
