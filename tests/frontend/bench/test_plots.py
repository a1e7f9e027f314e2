"""`deepinfer bench serve --plot` and `deepinfer bench sweep` against a real server: the JSON
holds what the plots draw, and the plots are images of the expected size; `--compare` draws
saved sweeps beside the new one (the figure checked line by line on made-up levels)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from deepinfer.frontend.bench.plots import output_rate, sweep_figure
from deepinfer.frontend.bench.serving import load_compared
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


def made_up_levels(scale: float) -> list[dict]:
    """Sweep levels as `bench sweep` saves them, with latencies and throughput from `scale`."""
    return [{"max_concurrency": c, "output_throughput": 100.0 * c * scale,
             "median_ttft_ms": 10.0 * c, "p99_ttft_ms": 20.0 * c,
             "median_itl_ms": 5.0 * scale, "p99_itl_ms": 9.0 * scale, "completed": 4}
            for c in (1, 2, 4)]


def save_sweep(path, label=None, scale=1.0, model="peer-model") -> None:
    path.write_text(json.dumps({"model": model, "base_url": "http://127.0.0.1:9", "label": label,
                                "endpoint": "/v1/completions", "levels": made_up_levels(scale)}))


def test_sweep_figure_draws_each_sweep_in_its_own_colour():
    import matplotlib.pyplot as plt

    fig = sweep_figure([("ours", made_up_levels(1.0)), ("peer", made_up_levels(0.5))])
    try:
        ttft, itl = fig.axes
        for ax, key in ((ttft, "ttft"), (itl, "itl")):
            lines = ax.get_lines()
            assert [line.get_label() for line in lines] == [
                "ours median", "ours p99", "peer median", "peer p99"]
            assert [t.get_text() for t in ax.get_legend().get_texts()] == [
                line.get_label() for line in lines]
            # x: the latency of each level, y: its output throughput.
            peer_p99 = made_up_levels(0.5)
            assert lines[3].get_xdata().tolist() == [lv[f"p99_{key}_ms"] for lv in peer_p99]
            assert lines[3].get_ydata().tolist() == [lv["output_throughput"] for lv in peer_p99]
            colours = [line.get_color() for line in lines]
            assert colours[0] == colours[1] != colours[2] == colours[3]
            # Every point labelled by its concurrency, for both sweeps.
            assert [t.get_text() for t in ax.texts] == ["1", "2", "4"] * 2
    finally:
        plt.close(fig)


def test_compared_sweeps_are_named_by_the_flag_or_what_they_recorded(tmp_path):
    save_sweep(tmp_path / "a.json")
    save_sweep(tmp_path / "b.json", label="llama-server F32")
    assert load_compared(str(tmp_path / "a.json"))[0] == "peer-model at http://127.0.0.1:9"
    assert load_compared(str(tmp_path / "b.json"))[0] == "llama-server F32"
    label, levels = load_compared(f"{tmp_path / 'a.json'}=llama.cpp Q4_1")
    assert label == "llama.cpp Q4_1" and levels == made_up_levels(1.0)
    (tmp_path / "c.json").write_text("{}")
    for bad in ("c.json", "missing.json", "missing.json=x"):
        with pytest.raises(ValueError, match="--compare"):
            load_compared(str(tmp_path / bad))


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


def test_bench_sweep_compare_draws_saved_sweeps_beside_its_own(server, tmp_path):
    peer, result = tmp_path / "peer.json", tmp_path / "ours.json"
    save_sweep(peer, scale=0.5)
    bench("sweep", "--base-url", server.base_url, "--concurrency", "1", "--num-prompts", "2",
          "--random-input-len", "8", "--random-output-len", "4", "--label", "tiny here",
          "--compare", f"{peer}=peer", "--result-file", str(result))
    sweep = json.loads(result.read_text())
    assert sweep["label"] == "tiny here" and sweep["model"] == "tiny"
    assert load_compared(str(result)) == ("tiny here", sweep["levels"])
    assert image_shape(result.with_suffix(".png"))[:2] == (450, 1200)


def test_bench_sweep_refuses_a_missing_compare_file_before_running(server, tmp_path):
    out = subprocess.run([sys.executable, "-m", "deepinfer", "bench", "sweep", "--base-url",
                          server.base_url, "--concurrency", "1", "--compare",
                          str(tmp_path / "nope.json")], capture_output=True, text=True,
                         timeout=120, cwd=tempfile.gettempdir())
    assert out.returncode == 2 and "--compare" in out.stderr
    assert "concurrency" not in out.stdout
