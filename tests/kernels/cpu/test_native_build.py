"""Native ops build once per variant and never hang on a dead builder's lock.

Each load runs in a fresh process (a server start), with TORCH_EXTENSIONS_DIR a temporary
folder and a small source of the test's own; a timeout keeps a hang from hanging the suite.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from deepinfer.kernels.cpu import native
from deepinfer.kernels.cpu.native import NativeOp

LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
import torch
from deepinfer.kernels.cpu.native import NativeOp
op = NativeOp(*sys.argv[1:4])
print("built" if op.load() is not None else f"fallback: {op.error}", flush=True)
if op.op is not None:
    print(op(torch.ones(2)).tolist())
"""
# A real op (~10 s to build: torch's headers), and a library with nothing in it (~1 s): enough
# to count builds, though the op it is asked for is then missing (and falls back).
TWICE = """
#include <ATen/core/Tensor.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>
at::Tensor test_twice(const at::Tensor& x) { return at::mul(x, 2); }
TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) { m.def("test_twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("test_twice", &test_twice); }
"""
EMPTY = 'extern "C" int deepinfer_test_empty() { return 1; }\n'


def _source(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.cpp"
    path.write_text(text)
    return str(path)


def _env(tmp_path: Path, **changes: str | None) -> dict[str, str]:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _load(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", LOAD, *args], env=env,
                              cwd=tempfile.gettempdir(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"loading native op {args[0]} still waited after {timeout} s: {e.stderr!r}")


@pytest.mark.slow  # a full native build, killed: guards the rare crash mid-build
def test_a_build_killed_midway_leaves_no_lock_that_hangs_the_next_start(tmp_path):
    args = ["twice", _source(tmp_path, "twice", TWICE), "test_twice"]
    env = _env(tmp_path)
    first = subprocess.Popen([sys.executable, "-c", LOAD, *args], env=env,
                             cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:  # killed, with its ninja and compiler, while it compiles (torch's lock is there)
        deadline = time.monotonic() + 120
        while not (locks := list((tmp_path / "ext").glob("*/lock"))):
            assert first.poll() is None and time.monotonic() < deadline, "no build seen"
            time.sleep(0.02)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert locks[0].exists() and not list((tmp_path / "ext").glob("*/*.so"))

    second = _load(args, env, timeout=150)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == ["built", "[2.0, 2.0]"], second.stderr
    assert "building native op twice (first use" in second.stderr
    assert f"removing {locks[0]}" in second.stderr


def test_waiting_for_a_live_build_is_logged_and_bounded(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(native, "BUILD_WAIT_S", 0.5)
    op = NativeOp("held", _source(tmp_path, "held", EMPTY), "test_empty")
    build_dir = op.build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "deepinfer.lock", "w") as held:  # another process, still building
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("12345\n")
        held.flush()
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="deepinfer.kernels"):
            assert op.load() is None
        assert time.monotonic() - start < 30
    assert op.error is not None and "gave up after" in op.error and "pid 12345" in op.error
    assert "waiting for another process (pid 12345) to finish building native op held" \
        in caplog.text
    assert not list(build_dir.glob("*.so"))  # it did not build meanwhile


def _ninja_paths(tmp_path: Path) -> dict[str, str]:
    """A PATH folder per ninja version found: the one on PATH and the pip package's."""
    import ninja

    found = {}
    for binary in (shutil.which("ninja"), os.path.join(ninja.BIN_DIR, "ninja")):
        if binary and os.access(binary, os.X_OK):
            version = subprocess.run([binary, "--version"], capture_output=True,
                                     text=True).stdout.strip()
            folder = tmp_path / f"ninja-{version}"
            folder.mkdir(exist_ok=True)
            if not (folder / "ninja").exists():
                (folder / "ninja").symlink_to(binary)
            found[version] = str(folder)
    return found


def _variants(kind: str, tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Two environments that build the same op differently, as a test process and a server
    started from an activated venv (ninja) or with CXX set (compiler) differ."""
    if kind == "ninja":  # 1.11 and 1.13 hash commands differently in .ninja_log
        folders = list(_ninja_paths(tmp_path).values())
        if len(folders) < 2:
            pytest.skip("one ninja version here")
        return tuple(_env(tmp_path, PATH=f"{f}{os.pathsep}{os.environ['PATH']}")
                     for f in folders[:2])
    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("no c++")
    return _env(tmp_path, CXX=None), _env(tmp_path, CXX=cxx)


@pytest.mark.parametrize("kind", ["compiler", "ninja"])
def test_alternating_variants_build_once_each(tmp_path, kind):
    first, second = _variants(kind, tmp_path)
    args = ["empty", _source(tmp_path, "empty", EMPTY), "test_empty"]
    builds = set()
    for env in (first, second, first):  # a test run, a server, a test run
        done = _load(args, env, timeout=120)
        assert done.returncode == 0 and "has no attribute 'test_empty'" in done.stdout, \
            done.stdout + done.stderr  # built and loaded; the op is not in it
        builds |= {(p, p.stat().st_mtime_ns) for p in (tmp_path / "ext").glob("*/*.so")}
    assert len(builds) == 2, sorted(builds)


def test_installs_at_other_paths_share_one_build(tmp_path):
    """A checkout, a wheel, a fresh clone: the same source at another path finds the build
    done (each op compiles a copy kept in its build folder), and another source builds apart."""
    env = _env(tmp_path)
    first, second = tmp_path / "checkout", tmp_path / "clone"
    builds = set()
    for folder, text in ((first, EMPTY), (second, EMPTY), (first, EMPTY), (second, EMPTY + "\n")):
        folder.mkdir(exist_ok=True)
        done = _load(["empty", _source(folder, "empty", text), "test_empty"], env, timeout=120)
        assert done.returncode == 0 and "has no attribute 'test_empty'" in done.stdout, \
            done.stdout + done.stderr
        builds |= {(p, p.stat().st_mtime_ns) for p in (tmp_path / "ext").glob("*/*.so")}
    assert len(builds) == 2, sorted(builds)  # the first source once, the changed one once


def test_prebuild_lists_every_native_op():
    """`make native` builds the ops prebuild names: a new op left off the list would be built by
    pytest's workers one at a time again (and, in a server, at its first request)."""
    from deepinfer.kernels.cpu import prebuild

    here = Path(native.__file__).parent
    holders = {path.stem for path in here.glob("*.py")
               if isinstance(getattr(importlib.import_module(f"deepinfer.kernels.cpu.{path.stem}"),
                                     "_OP", None), NativeOp)}
    assert holders == set(prebuild.OP_MODULES)
