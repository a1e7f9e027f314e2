"""`deepinfer bench serve --plot` and `deepinfer bench sweep` against a real server: the JSON
holds what the plots draw, and the plots are images of the expected size."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from deepinfer.frontend.bench.plots import output_rate
from scripts.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "128", "--max-model-len", "512",
                        "--served-model-name", "tiny")
    yield srv
    srv.stop()


def bench(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "deepinfer", "bench", *args, "--disable-tqdm"],
                         capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def image_shape(path) -> tuple[int, ...]:
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path).shape


def test_output_rate_counts_arrivals_per_second():
    x, rate = output_rate([0.1, 0.2, 1.5, 1.6, 1.7, 1.8], duration=2.0, bins=2)
    assert x.tolist() == [0.5, 1.5] and rate.tolist() == [2.0, 4.0]


def test_bench_serve_plots_its_run(server, tmp_path):
    result, plot = tmp_path / "run.json", tmp_path / "run.png"
    bench("serve", "--base-url", server.base_url, "--num-prompts", "8",
          "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency", "4",
          "--result-file", str(result), "--plot", str(plot))
    report = json.loads(result.read_text())
    assert report["completed"] == 8
    # One arrival per streamed chunk; the first of each request at its TTFT.
    assert len(report["token_times"]) == 8 + len(report["itls"])
    assert 0 < min(report["token_times"]) <= max(report["token_times"]) <= report["duration_s"]
    assert image_shape(plot)[:2] == (420, 1500)


def test_bench_sweep_runs_each_level_and_plots_them(server, tmp_path):
    result = tmp_path / "sweep.json"
    out = bench("sweep", "--base-url", server.base_url, "--concurrency", "1,2", "--num-prompts",
                "4", "--random-input-len", "16", "--random-output-len", "8",
                "--result-file", str(result))
    sweep = json.loads(result.read_text())
    assert [lv["max_concurrency"] for lv in sweep["levels"]] == [1, 2]
    assert all(lv["completed"] == 4 and lv["output_throughput"] > 0 for lv in sweep["levels"])
    assert np.isfinite([lv["p99_ttft_ms"] for lv in sweep["levels"]]).all()
    assert "concurrency    2" in out.stdout
    assert image_shape(result.with_suffix(".png"))[:2] == (450, 1200)


def test_bench_sweep_refuses_a_bad_level(server):
    out = subprocess.run([sys.executable, "-m", "deepinfer", "bench", "sweep", "--base-url",
                          server.base_url, "--concurrency", "0,2"], capture_output=True,
                         text=True, timeout=120, cwd=tempfile.gettempdir())
    assert out.returncode == 2 and "--concurrency" in out.stderr
