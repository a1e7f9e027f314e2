"""The engine's children import DeepInfer's own packages, whatever the caller's working directory
and whatever else is on PYTHONPATH (Hugging Face's `kernels` shares our top-level name)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.runtime.launcher import child_argv, child_env
from engine.runtime.process_entry import PACKAGE_ROOT

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def foreign_kernels(tmp_path) -> Path:
    """A directory holding another distribution's `kernels` package, as HF's would be. Importing
    it fails loudly (a foreign package without a `cpu` would not: our editable install's finder
    would still supply `kernels.cpu` under it, by accident)."""
    root = tmp_path / "foreign"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text(
        "raise ImportError('the foreign kernels package was imported')\n")
    return root


def test_children_put_our_packages_first():
    assert PACKAGE_ROOT == REPO  # tests run from the checkout
    env = child_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(PACKAGE_ROOT)
    argv = child_argv("x")
    assert argv[0] == sys.executable and argv[-3:] == ["-m", "engine.runtime.process_entry", "x"]
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


def test_a_shadowed_package_is_one_clear_line(foreign_kernels, tmp_path):
    # Foreign first on the path: what a child would meet without the launcher's PYTHONPATH.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(foreign_kernels), str(REPO)]))
    code = "from engine.runtime.process_entry import check_own_packages; check_own_packages()"
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("engine.runtime.process_entry.ForeignPackageError: the package "
                           "'kernels' resolves to") and str(foreign_kernels) in last
