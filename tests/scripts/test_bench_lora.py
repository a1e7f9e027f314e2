"""scripts/bench_lora.py's pure parts: its arguments and server flags, the adapters it makes,
the requests it sends, and its report (no server is started)."""

from __future__ import annotations

import json

import pytest

from deepinfer.frontend.bench.client import RequestResult
from scripts import bench_lora as bench


def test_defaults_are_the_full_run_and_quick_is_short_unless_told_otherwise():
    args = bench.parse_args([])
    assert (args.num_prompts, args.input_len, args.output_len, args.rounds) == (64, 128, 128, 2)
    assert (args.num_adapters, args.rank, args.model) == (8, 16, "default")
    quick = bench.parse_args(["--quick"])
    assert (quick.num_prompts, quick.output_len, quick.rounds) == (16, 32, 1)
    assert bench.parse_args(["--quick", "--rounds", "3"]).rounds == 3


@pytest.mark.parametrize("argv", [["--num-prompts", "0"], ["--rounds", "0"], ["--rank", "0"],
                                  ["--input-len", "900", "--output-len", "200"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_both_servers_share_their_flags_and_the_lora_server_names_every_adapter(tmp_path):
    args = bench.parse_args(["--serve-args", "--worker-threads 2"])
    shared = bench.serve_flags(args)
    assert shared[:2] == ["--served-model-name", "base"] and shared[-2:] == [
        "--worker-threads", "2"]
    adapters = {name: tmp_path / name for name in bench.adapter_names(8)}
    flags = bench.lora_flags(adapters, 16)
    assert flags[:5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "8"]
    assert f"a7={tmp_path / 'a7'}" in flags and flags[-1] == bench.RUNTIME_FLAG


def test_requests_cycle_over_the_models_and_each_seed_draws_its_own_prompts():
    models = bench.adapter_names(8)
    bodies = bench.request_bodies(16, 32, 8, models, seed=0)
    assert [b["model"] for b in bodies] == models * 2
    assert all(b["max_tokens"] == 8 and b["ignore_eos"] and b["stream"]
               and b["temperature"] == 0.0 for b in bodies)
    assert len(bodies[0]["prompt"].split()) == 32
    prompts = [b["prompt"] for b in bodies]
    assert prompts == [b["prompt"] for b in bench.request_bodies(16, 32, 8, ["base"], seed=0)]
    assert not set(prompts) & {b["prompt"] for b in bench.request_bodies(16, 32, 8, models, 1)}


def test_adapters_are_peft_directories_of_distinct_random_nonzero_weights(tiny_model_dir,
                                                                          tmp_path):
    from safetensors.torch import load_file

    paths = bench.make_adapters(tiny_model_dir, tmp_path / "a", ["a0", "a1"], 16, seed=5)
    again = bench.make_adapters(tiny_model_dir, tmp_path / "b", ["x"], 16, seed=5)
    config = json.loads((paths["a0"] / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 32)
    assert sorted(config["target_modules"]) == sorted(bench.TARGETS)
    a0, a1, x = (load_file(p / "adapter_model.safetensors")
                 for p in (paths["a0"], paths["a1"], again["x"]))
    b_weights = [k for k in a0 if "lora_B" in k]
    assert len(b_weights) == 3 * len(bench.TARGETS)  # every target of the 3 layers
    for k in b_weights:
        assert 0.01 < float(a0[k].std()) < 0.03
        assert not a0[k].equal(a1[k])
    assert all(a0[k].equal(x[k]) for k in a0)  # the same seed, the same adapter


def result(ttft: float, output_tokens: int = 4, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, error="" if ok else "HTTP 500", prompt_tokens=10,
                         output_tokens=output_tokens, ttft=ttft, e2e=ttft + 0.3,
                         itl=[0.1, 0.1, 0.1])


def config(tok_s: float, ttft_p99_ms: float) -> dict:
    row = {"output_tok_s": tok_s, "ttft_p50_ms": ttft_p99_ms / 2, "ttft_p99_ms": ttft_p99_ms,
           "itl_p50_ms": 50.0, "itl_p99_ms": 100.0, "failed": 0, "wrong_length": 0,
           "errors": []}
    return {"rounds": [row], "best": row}


def test_a_run_is_summarized_and_its_best_round_is_reported():
    row = bench.summary([result(0.2), result(0.4), result(0.1, ok=False)], 2.0, 4)
    assert row["output_tok_s"] == 4.0 and (row["completed"], row["failed"]) == (2, 1)
    assert row["ttft_p50_ms"] == pytest.approx(300.0) and row["itl_p99_ms"] == pytest.approx(
        100.0)
    assert row["errors"] == ["HTTP 500"] and row["wrong_length"] == 0
    assert bench.summary([result(0.2, output_tokens=3)], 1.0, 4)["wrong_length"] == 1
    rounds = [{"output_tok_s": 90.0}, {"output_tok_s": 100.0}, {"output_tok_s": 95.0}]
    assert bench.best_round(rounds) is rounds[1]


def test_ratios_and_the_table_compare_each_lora_configuration_with_the_base_alone():
    out = {"configs": {"base_alone": config(200.0, 1000.0), "adapters": config(150.0, 1500.0),
                       "base_on_lora": config(190.0, 1100.0)}}
    out["ratios"] = bench.ratios(out["configs"])
    assert out["ratios"]["adapters"] == {"output_tok_s": 0.75, "ttft_p99_ms": 1.5,
                                         "itl_p99_ms": 1.0}
    assert out["ratios"]["base_on_lora"]["output_tok_s"] == pytest.approx(0.95)
    out["adapter_load"] = {"available": False, "note": "404"}
    text = bench.table(out)
    assert "| adapters | 150.0 | 750 | 1500 |" in text
    assert "output tok/s 0.75x, TTFT p99 1.50x" in text and ": met)" in text
    assert "adapter load: not available" in text
    assert "WARNING" not in text
    out["configs"]["adapters"] = config(100.0, 1500.0)
    out["configs"]["adapters"]["best"]["other_cores"] = 0.8
    out["ratios"] = bench.ratios(out["configs"])
    text = bench.table(out)
    assert "NOT met" in text and "| 0.80 |" in text
    assert "WARNING: other processes used up to 0.80 cores" in text
    assert bench.failures(out) == []


def test_other_processes_cores_are_the_host_busy_time_less_ours_over_the_wall_time():
    assert bench.other_cores((100.0, 10.0), (103.0, 12.0), 2.0) == 0.5
    assert bench.other_cores((100.0, 10.0), (101.0, 12.0), 2.0) == 0.0
    assert bench.other_cores((None, 10.0), (None, 12.0), 2.0) is None


HISTOGRAM = """\
# HELP deepinfer_lora_load_seconds seconds to load a LoRA adapter
# TYPE deepinfer_lora_load_seconds histogram
deepinfer_lora_load_seconds_bucket{le="0.1"} 2.0
deepinfer_lora_load_seconds_bucket{le="+Inf"} 3.0
deepinfer_lora_load_seconds_count 3.0
deepinfer_lora_load_seconds_sum 0.5
# HELP deepinfer_other_total something else
# TYPE deepinfer_other_total counter
deepinfer_other_total 7.0
"""


def test_the_load_histogram_is_read_from_metrics_text():
    assert bench.histogram_totals(HISTOGRAM, bench.LOAD_METRIC) == {"sum": 0.5, "count": 3.0}
    assert bench.histogram_totals(HISTOGRAM, "deepinfer_missing_seconds") is None


def fake_server(monkeypatch, answers: dict[str, tuple[int, str]], histograms: list) -> list:
    """post_json answers by path; load_histogram returns `histograms` in turn."""
    sent = []

    def post_json(url, body, timeout=120.0):
        sent.append((url.split("/", 3)[3], body))
        return answers["/" + url.split("/", 3)[3]]

    monkeypatch.setattr(bench, "post_json", post_json)
    monkeypatch.setattr(bench, "load_histogram", lambda url: histograms.pop(0))
    return sent


def test_a_server_without_the_load_endpoint_reports_not_available(monkeypatch, tmp_path):
    fake_server(monkeypatch, {"/v1/load_lora_adapter": (404, "Not Found")}, [None])
    out = bench.adapter_load("http://h:1", tmp_path, "a0")
    assert out["available"] is False and "404" in out["note"]
    assert "not available" in bench.load_line(out) and bench.failures(
        {"configs": {}, "adapter_load": out}) == []


def test_a_load_is_timed_used_and_undone(monkeypatch, tmp_path):
    completion = (200, json.dumps({"usage": {"completion_tokens": 8}}))
    sent = fake_server(monkeypatch, {
        "/v1/load_lora_adapter": (200, "Success"), "/v1/completions": completion,
        "/v1/unload_lora_adapter": (200, "Success")},
        [{"sum": 0.2, "count": 8.0}, {"sum": 0.25, "count": 9.0}])
    out = bench.adapter_load("http://h:1", tmp_path, "a0")
    assert [path for path, _ in sent] == ["v1/load_lora_adapter", "v1/completions",
                                          "v1/completions", "v1/unload_lora_adapter"]
    assert sent[0][1] == {"lora_name": "extra", "lora_path": str(tmp_path)}
    assert [body["model"] for _, body in sent[1:3]] == ["a0", "extra"]
    assert sent[3][1] == {"lora_name": "extra"}
    assert out["available"] and "error" not in out and out["load_s"] >= 0
    assert out["server_load_s"] == {"sum": pytest.approx(0.05), "count": 1.0}
    assert "over 1 load(s)" in bench.load_line(out)


def test_a_failed_request_to_the_loaded_adapter_is_a_failure(monkeypatch, tmp_path):
    fake_server(monkeypatch, {
        "/v1/load_lora_adapter": (200, "Success"),
        "/v1/completions": (404, "no model 'extra'"),
        "/v1/unload_lora_adapter": (200, "Success")}, [None, None])
    out = bench.adapter_load("http://h:1", tmp_path, "a0")
    assert "extra" in out["error"] and "server_load_s" not in out
    assert bench.failures({"configs": {}, "adapter_load": out}) == [out["error"]]
