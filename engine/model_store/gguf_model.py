"""A GGUF file served as it is, its weights still quantized, through a "sidecar" directory.

The engine takes its config and tokenizer from a model directory, so a GGUF gets one in the cache
holding config.json, generation_config.json and the tokenizer files written from its metadata,
and gguf.json naming the file: no weights, the workers read those from the GGUF itself
(workers/quantization/gguf.py). It is keyed by the file's absolute path, size and mtime, so a
replaced file gets a fresh one, and appears whole or not at all (temporary sibling, renamed).

gguf and tokenizers are imported only to make a sidecar: checking one stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from deepinfer.engine import envs
from deepinfer.engine.model_store.errors import ModelPrepareError

SOURCE_FILE = "gguf.json"  # {"path": the GGUF this directory stands for}
# GGML types the workers serve (workers/quantization/gguf.py); checked when the sidecar is made,
# so another one is reported before any process starts.
SERVED_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K", "Q5_K"})


def unsupported_type(tensor: str, qtype: str) -> str:
    return (f"GGUF tensor {tensor!r} is {qtype}, which cannot be served (supported: "
            f"{', '.join(sorted(SERVED_TYPES))}); re-quantize the file with llama.cpp's "
            "llama-quantize, e.g. to Q8_0 or Q4_0, or give a Hugging Face model directory")


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF a sidecar directory stands for; None for an ordinary model directory."""
    source = Path(model_dir) / SOURCE_FILE
    if not source.is_file():
        return None
    return Path(json.loads(source.read_text())["path"])


def sidecar_dir(gguf_path: Path, cache: Path | None = None) -> Path:
    """Where the sidecar of `gguf_path` (an existing file) lives, made or not."""
    path = gguf_path.expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return (cache or envs.cache_dir()) / "gguf" / key[:16] / path.stem


def prepare_gguf_model(gguf_path: Path, cache: Path | None = None) -> Path:
    """The sidecar directory of `gguf_path`, made first if it is not there. Raises
    ModelPrepareError for a file that is no GGUF or that holds an unsupported tensor type or
    architecture."""
    out = sidecar_dir(gguf_path, cache)
    if _is_sidecar(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_sidecar(gguf_path.expanduser().resolve(), tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is shared like any other
        if out.exists():  # left incomplete by hand: _is_sidecar said no
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not _is_sidecar(out):  # else a concurrent run made it first: as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _is_sidecar(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "tokenizer.json", SOURCE_FILE))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _write_sidecar(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader

    from deepinfer.engine.model_store.gguf_config import generation_config, model_config
    from deepinfer.engine.model_store.gguf_metadata import read_metadata
    from deepinfer.engine.model_store.gguf_tokenizer import write_tokenizer

    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise ModelPrepareError(f"{gguf_path} is not a readable GGUF file: {exc}") from None
    for t in reader.tensors:
        if t.tensor_type.name not in SERVED_TYPES:
            raise ModelPrepareError(unsupported_type(t.name, t.tensor_type.name))
    meta = read_metadata(reader)
    config = model_config(meta, {t.name for t in reader.tensors})
    write_tokenizer(meta, out)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(meta))
    _write_json(out / SOURCE_FILE, {"path": str(gguf_path)})
