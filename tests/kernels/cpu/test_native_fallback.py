"""A native op that cannot be built says so once, as a warning with the cause and the cost."""

from __future__ import annotations

import logging

import torch

from deepinfer.kernels.cpu.native import NativeOp


def test_build_failure_is_logged_once(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # its empty folder, not the user's
    op = NativeOp("missing_source", "does_not_exist.cpp", "nope")
    x = torch.zeros(2, 2)
    with caplog.at_level(logging.WARNING, logger="deepinfer.kernels"):
        assert not op.available(x)
        assert not op.available(x)  # cached: no second build, no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "missing_source could not be built" in message and "does_not_exist.cpp" in message
    assert "falls back to plain torch" in message and op.error and op.error in message
