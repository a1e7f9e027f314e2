"""The built wheel, installed into a fresh venv beside the newest transformers and Hugging Face's
`kernels` package, works from anywhere (slow: ~3-5 min).

The wheel holds one top-level package, `deepinfer`; it must carry the native kernels' C++
sources (they are compiled on first use) and everything `deepinfer prepare-model` needs. Hugging
Face's `kernels` (required by transformers >= 5.25) imports beside `deepinfer.kernels`; then
`deepinfer serve` from that venv, started outside the checkout, answers the default model's known
greedy reply, with every native op built. To avoid downloading torch, the fresh venv sees the
running interpreter's site-packages through a .pth file: a plain path line, so the editable
install's finder there is not activated and DeepInfer comes from the wheel alone; pip resolves
the wheel together with transformers>=5.25 and kernels (installing into the venv what that
site-packages lacks).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from scripts.server_process import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
CSRC = sorted(p.name for p in (REPO / "kernels/cpu/csrc").iterdir()
              if p.suffix in (".cpp", ".h"))
FALLBACK = "could not be built"  # kernels/cpu/native.py's warning

pytestmark = pytest.mark.slow

CHECK_INSTALL = """
import importlib.metadata, logging, sys
from pathlib import Path
import torch
import deepinfer, deepinfer.kernels, kernels, transformers
from deepinfer import LLM, SamplingParams
from deepinfer.kernels.cpu import attention, decode_layer, fused, linear
logging.basicConfig(level=logging.WARNING)
site = Path(sys.argv[1]).resolve()
assert Path(deepinfer.__file__).resolve().is_relative_to(site), deepinfer.__file__
assert hasattr(kernels, "get_kernel"), kernels.__file__  # Hugging Face's, not ours
assert "deepinfer" not in Path(kernels.__file__).resolve().parts, kernels.__file__
version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
assert version >= (5, 25), transformers.__version__
print("top level", importlib.metadata.distribution("deepinfer").read_text("top_level.txt"))
csrc = Path(deepinfer.kernels.__file__).parent / "cpu" / "csrc"
print("csrc", sorted(p.name for p in csrc.iterdir()))
x = torch.zeros(2, 2)
for op in (linear, fused, attention, decode_layer):
    assert op.available(x), (op.__name__, op.build_error())
print("native ops built")
"""


def _source_tree(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored): no build/ or
    .egg-info leftovers in the wheel, and nothing written into the checkout."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
        capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_symlink():  # deepinfer/engine -> ../engine, ...: links stay links
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).symlink_to(os.readlink(REPO / name))
        elif (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _run(cmd: list, timings: dict, step: str, **kwargs) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    timings[step] = time.monotonic() - t0
    assert proc.returncode == 0, f"{step}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_installs_prepares_and_serves(tmp_path):
    timings: dict[str, float] = {}
    src = _source_tree(tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", "."],
         timings, "pip wheel", cwd=src)
    (wheel,) = (tmp_path / "dist").glob("deepinfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"deepinfer/kernels/cpu/csrc/{n}" for n in CSRC} <= names, sorted(names)
    assert "deepinfer/engine/model_store/prepare.py" in names
    # Nothing of ours outside `deepinfer` (a top-level `kernels` is Hugging Face's).
    assert {n.split("/")[0] for n in names} == {"deepinfer", wheel.name[:-4].rsplit("-", 3)[0]
                                                + ".dist-info"}, sorted(names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], timings, "venv")
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], timings,
         "pip install")
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     timings, "site").stdout.strip())
    # After the install, so pip never sees the dev environment's (editable) deepinfer.
    (site / "dev-site-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # What a user of a current transformers asks for (transformers >= 5.25 requires `kernels`),
    # resolved against the wheel's own requirements (a pin on transformers failed here); what
    # the dev environment already has is not downloaded again.
    _run([py, "-m", "pip", "install", "-q", wheel, "transformers>=5.25", "kernels"], timings,
         "pip install with transformers kernels")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"DEEPINFER_CACHE": str(tmp_path / "cache"), "TOKENIZERS_PARALLELISM": "false",
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
            "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    check = _run([py, "-c", CHECK_INSTALL, site], timings, "native builds", cwd=elsewhere,
                 env=env)
    assert f"csrc {CSRC}" in check.stdout and "native ops built" in check.stdout, check.stdout
    assert "top level deepinfer\n" in check.stdout, check.stdout
    assert FALLBACK not in check.stderr, check.stderr

    prep = _run([bin_dir / "deepinfer", "prepare-model"], timings, "prepare-model",
                cwd=elsewhere, env=env)
    model_dir = Path(prep.stdout.strip().splitlines()[-1])
    assert model_dir == tmp_path / "cache" / "SmolLM2-135M-Instruct"
    assert (model_dir / "model.safetensors").exists()

    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    t0 = time.monotonic()
    server = subprocess.Popen([bin_dir / "deepinfer", "serve", "--model", "default", "--port",
                               str(port)], cwd=elsewhere, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_healthy(url, server, 300), Path(log.name).read_text()
        timings["serve start"] = time.monotonic() - t0
        t0 = time.monotonic()
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "default", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user",
                          "content": "What is the capital of France? Answer briefly."}]})
        timings["chat completion"] = time.monotonic() - t0
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == \
            "The capital of France is Paris."
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
    output = Path(log.name).read_text()
    assert server.returncode == 0, output
    assert FALLBACK not in output and "Traceback" not in output, output
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})
