"""gguf_index's own reading of a GGUF file against gguf-py's GGUFReader: the same key/values and
the same tensors (names, dims, types, bytes), faster; a damaged file refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.gguf_index import read_index
from deepinfer.engine.model_store.gguf_metadata import read_metadata
from tests.engine.model_store import tiny_gguf


def _all(kind: Q):
    return lambda name: Q.F32 if name.endswith("norm.weight") else kind


@pytest.mark.parametrize("qtype", [tiny_gguf._qtype, _all(Q.F16), _all(Q.BF16), _all(Q.Q8_0)],
                         ids=["mixed", "f16", "bf16", "q8_0"])
def test_same_metadata_and_tensors_as_gguf_py(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path, tied=False, qtype=qtype)
    reader = GGUFReader(str(path))
    index = read_index(str(path))
    assert index.metadata == read_metadata(reader)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape.tolist() == theirs.shape.tolist(), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        np.testing.assert_array_equal(ours.data, theirs.data, err_msg=ours.name)


def test_tensors_are_copy_on_write_views(tmp_path):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path)
    before = path.read_bytes()
    t = read_index(str(path)).tensors[0]
    t.data.reshape(-1).view(np.uint8)[0] ^= 0xFF  # writable, and the write stays here
    assert path.read_bytes() == before


@pytest.mark.parametrize("cut", [3, 30, 400, -10])
def test_a_truncated_file_is_refused(tmp_path, cut):
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(ModelPrepareError, match="tiny.gguf"):
        read_index(str(path))


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(ModelPrepareError, match="not a GGUF"):
        read_index(str(path))
