"""Sets up the Triton interpreter (when there is no GPU) before this folder's tests import the
kernels (see device.py), and prints the worst error of each kernel after the run."""

from __future__ import annotations

import os

from tests.kernels.triton import device


def pytest_terminal_summary(terminalreporter) -> None:
    if not device.ERRORS:
        return
    where = "cuda" if device.ON_GPU else "cpu, TRITON_INTERPRET=1"
    lines = [f"{kernel:<22} {dtype:<9} max abs err {err:.2e} (bound {tol:.0e})"
             for (kernel, dtype), (err, tol) in sorted(device.ERRORS.items())]
    terminalreporter.section(f"triton kernels vs torch references ({where})")
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get("DEEPINFER_KERNEL_REPORT")  # scripts/gpu_check.sh reads it back
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
