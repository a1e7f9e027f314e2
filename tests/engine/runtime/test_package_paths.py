"""DeepInfer is one import package, `deepinfer`, whose subpackages are the repository's top-level
folders (linked in: deepinfer/engine -> ../engine, ...); nothing of ours shares a name with
another distribution (Hugging Face's `kernels` has the name of our kernels/ folder), whatever the
caller's working directory and PYTHONPATH."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.engine.runtime.launcher import child_argv

REPO = Path(__file__).resolve().parents[3]
FOLDERS = ("engine", "frontend", "workers", "kernels")


@pytest.fixture()
def foreign_kernels(tmp_path) -> Path:
    """A directory holding another distribution's `kernels` package, as HF's would be. Importing
    it fails loudly."""
    root = tmp_path / "foreign"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text(
        "raise ImportError('the foreign kernels package was imported')\n")
    return root


def test_every_folder_is_a_subpackage_of_deepinfer():
    """setuptools finds the packages (no list to keep by hand: a new folder left out of one would
    be missing from the wheel): pyproject's `find` yields every package of the four folders,
    reached through deepinfer/<folder> links, and nothing else of ours."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools import find_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == {"find"} and "package-dir" not in config
    found = find_packages(str(REPO), **config["packages"]["find"])
    expected = {"deepinfer"} | {
        "deepinfer." + ".".join(p.parent.relative_to(REPO).parts)
        for folder in FOLDERS for p in (REPO / folder).rglob("__init__.py")}
    assert sorted(found) == sorted(expected)


def test_the_distribution_installs_one_top_level_package():
    top = importlib.metadata.distribution("deepinfer").read_text("top_level.txt")
    assert top.split() == ["deepinfer"]
    assert Path(deepinfer.__file__).parent == REPO / "deepinfer"  # the checkout, editable


def test_children_run_the_installed_package_without_the_working_directory():
    argv = child_argv("x")
    assert argv[0] == sys.executable
    assert argv[-3:] == ["-m", "deepinfer.engine.runtime.process_entry", "x"]
    assert ("-P" in argv) == (sys.version_info >= (3, 11))  # the cwd is not on their path


def test_engine_starts_beside_a_foreign_kernels_package(
        tiny_model_dir, foreign_kernels, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing of ours on the cwd path
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PYTHONPATH", str(foreign_kernels))
    llm = LLM(str(tiny_model_dir), num_kv_blocks=32)
    try:
        out = llm.generate(["hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        assert len(out.token_ids) == 2
    finally:
        llm.shutdown()

