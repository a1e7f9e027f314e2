"""Shared fixtures: tiny random HF checkpoints (built once per session), the default model, and
a private DeepInfer cache for the session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepinfer.engine.config import DEFAULT_MODEL_NAME
from deepinfer.engine.envs import cache_dir
from scripts.tiny_models import save_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _own_cores_under_xdist() -> None:
    """Under pytest-xdist (`make test` runs one pytest worker per core), each worker and every
    process it starts keep to their own cores, and compute with that many threads: two engines'
    OpenMP thread pools spinning on the same two cores slowed a test 13-fold. A worker sizes
    its threads from its affinity (workers/worker_process.py), so engines follow by themselves."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count > len(cores):
        return
    mine = cores[int(worker[2:]) % count::count]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # read when torch starts, here and in children


_own_cores_under_xdist()

# The user's cache, taken before session_cache points DEEPINFER_CACHE elsewhere: the default
# model is prepared there once (~15 s) and read from there by every session.
USER_CACHE = cache_dir()
_session_cache: Path | None = None


def default_model_dir() -> Path:
    """The default model in the user's cache, prepared (downloaded and converted, ~15 s) if it
    is not yet; the session's cache gets a link to it, so that 'default' finds it there too."""
    from deepinfer.engine.model_store import prepare

    path = prepare(DEFAULT_MODEL_NAME, USER_CACHE)
    if _session_cache is not None:
        _link(_session_cache / DEFAULT_MODEL_NAME, path)
    return path


def _link(link: Path, target: Path) -> None:
    if not link.exists() and not link.is_symlink():
        link.symlink_to(target, target_is_directory=True)


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory) -> Iterator[Path]:
    """DEEPINFER_CACHE for the session and the servers it starts: a temporary folder, so that
    GGUF sidecars and whatever else DeepInfer caches never land in the user's cache. Its
    prepared models are linked in, to be read (preparing one again replaces its link, it never
    writes through it), and so is its downloads folder: a model's wheel is kept where preparing
    that model outside the tests would keep it."""
    global _session_cache
    from deepinfer.engine.model_store import RECIPES, is_prepared

    cache = tmp_path_factory.mktemp("deepinfer-cache")
    for recipe in RECIPES.values():
        if is_prepared(USER_CACHE / recipe.dir_name):
            _link(cache / recipe.dir_name, USER_CACHE / recipe.dir_name)
    if (USER_CACHE / "downloads").is_dir():
        _link(cache / "downloads", USER_CACHE / "downloads")
    _session_cache = cache
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_CACHE", str(cache))
        yield cache
    _session_cache = None


@pytest.fixture(scope="session")
def default_model() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 3-layer, 64-wide random Llama that shares SmolLM2's tokenizer and chat template."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"),
                           tokenizer_from=default_model_dir())


# A request of NEVER_ENDING tokens runs for minutes (the tiny model decodes ~500 tokens/s here):
# a test that aborts it cannot race its natural end, however slow the machine or the disconnect.
LONG_CONTEXT = 65536
NEVER_ENDING = 60000


@pytest.fixture(scope="session")
def long_tiny_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model (same weights: RoPE has no parameters) with a LONG_CONTEXT context."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-long"), tokenizer_from=tiny_model_dir,
                           max_position_embeddings=LONG_CONTEXT)
