"""The KV identity key (engine/kv_identity.py) covers everything that changes a block's bytes:
two servers that would compute different KV for the same tokens never share a key (and so
never share a disk-tier folder or KV events), whatever a weight sample would have missed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from deepinfer.engine import envs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_identity import file_digest, kv_block_identity, model_fingerprint


@pytest.fixture(autouse=True)
def _fresh_fingerprints():
    model_fingerprint.cache_clear()  # each test rewrites files in place
    yield
    model_fingerprint.cache_clear()


def copy_model(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def identity(model: Path, **settings) -> bytes:
    return kv_block_identity(EngineConfig(model=str(model), **settings))


def test_a_byte_no_weight_sample_reads_changes_the_identity(tiny_model_dir, tmp_path):
    """Two checkpoints differing in one weight byte, at an offset between the 32 evenly spaced
    4 KiB samples an earlier key read."""
    a = copy_model(tiny_model_dir, tmp_path / "a")
    b = copy_model(tiny_model_dir, tmp_path / "b")
    weights = b / "model.safetensors"
    size = weights.stat().st_size
    offset = size // 32 + 4096 + 100  # past the 2nd sample's 4 KiB
    data = bytearray(weights.read_bytes())
    data[offset] ^= 0x01
    weights.write_bytes(bytes(data))
    assert identity(a) != identity(b)


def test_quantization_replay_mode_and_draft_rows_change_the_identity(tiny_model_dir, tmp_path):
    base = identity(tiny_model_dir)
    assert identity(tiny_model_dir, quantization="int8") != base
    assert identity(tiny_model_dir, speculative_method="draft",
                    speculative_model=str(tiny_model_dir)) != base
    assert identity(tiny_model_dir, speculative_method="ngram") == base  # no rows of its own
    swa = copy_model(tiny_model_dir, tmp_path / "swa", sliding_window=8,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert identity(swa, swa_replay="exact") != identity(swa, swa_replay="window")
    assert identity(tiny_model_dir, swa_replay="exact") == base  # no sliding layers: no replay


def test_two_gguf_files_behind_equal_sidecars_have_different_identities(tiny_model_dir,
                                                                         tmp_path):
    """A sidecar directory holds the GGUF's config and tokenizer but no weights: the key reads
    the GGUF file it names."""
    sidecars = []
    for name, content in (("a", b"GGUF one"), ("b", b"GGUF two")):
        gguf = tmp_path / f"{name}.gguf"
        gguf.write_bytes(content)
        side = tmp_path / f"side-{name}"
        side.mkdir()
        shutil.copy(tiny_model_dir / "config.json", side / "config.json")
        (side / "gguf.json").write_text(json.dumps({"path": str(gguf)}))
        sidecars.append(side)
    assert identity(sidecars[0]) != identity(sidecars[1])


def test_a_files_digest_is_kept_in_the_cache_by_path_size_and_mtime(tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x" * 10000)
    real = file_digest(weights)
    memos = list((envs.cache_dir() / "kv-identity").iterdir())
    assert [p for p in memos if p.read_text() == real]  # in DEEPINFER_CACHE, not beside it
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]
    for memo in memos:
        if memo.read_text() == real:
            memo.write_text("f" * 64)
    assert file_digest(weights) == "f" * 64  # not read again
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert file_digest(weights) == real  # a rewritten file is read again
