"""Process lifecycle: clean shutdown, signals, a dying child, a child that cannot start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer import LLM, SamplingParams
from deepinfer.engine.config import ModelConfigError
from deepinfer.engine.runtime.launcher import EngineStartupError


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_shutdown_stops_children_and_removes_sockets(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    pids = [p.pid for p in llm.client.launcher.procs.values()]
    root = Path(llm.client.launcher.endpoints.root)
    assert len(pids) == 3 and root.exists() and oct(root.stat().st_mode & 0o777) == "0o700"
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids
    t0 = time.monotonic()
    llm.shutdown()
    assert wait_gone(pids, 5.0) == [] and time.monotonic() - t0 < 5.0
    assert not root.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_parent_leaves_no_orphans(tiny_model_dir, tmp_path, sig):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, time
        # Ctrl-C semantics, whatever the parent left: a job started in the background by a
        # non-interactive shell inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from deepinfer import LLM
        llm = LLM({str(tiny_model_dir)!r}, num_kv_blocks=64)
        launcher = llm.client.launcher
        print(launcher.endpoints.root, *[p.pid for p in launcher.procs.values()], flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    try:
        root, *pids = proc.stdout.readline().split()
        proc.send_signal(sig)
        proc.wait(timeout=30)  # seconds normally; a loaded 2-core CI box can take longer
    finally:
        proc.kill()
    assert wait_gone([int(p) for p in pids], 5.0) == []
    deadline = time.monotonic() + 5
    while Path(root).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(root).exists()


def test_dead_worker_is_reported_and_engine_stops(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    procs = llm.client.launcher.procs
    others = [p.pid for name, p in procs.items() if name != "worker0"]
    os.kill(procs["worker0"].pid, signal.SIGKILL)
    assert wait_gone(others, 5.0) == []
    assert "worker0 exited (code -9)" in (llm.client.dead_reason or "")
    with pytest.raises(Exception, match="worker0"):
        llm.generate(["hello"], SamplingParams(max_tokens=4))
    llm.shutdown()


def test_worker_that_cannot_load_reports_why(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ModelConfigError, match="safetensors"):  # checked before any process
        LLM(str(broken), num_kv_blocks=8)
    save_file({"not.a.weight": torch.zeros(2)}, str(broken / "model.safetensors"))
    with pytest.raises(EngineStartupError, match="worker0.*not.a.weight"):
        LLM(str(broken), num_kv_blocks=8)


def test_without_overlap_scheduling_results_are_the_same(tiny_model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    with LLM(str(tiny_model_dir), num_kv_blocks=64, overlap_scheduling=False) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(tiny_model_dir), num_kv_blocks=64) as llm:
        overlapped = [o.token_ids for o in llm.generate(prompts, params)]
    assert plain == overlapped and all(len(t) == 12 for t in plain)
