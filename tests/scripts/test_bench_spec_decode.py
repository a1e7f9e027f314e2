"""scripts/bench_spec_decode.py: its arguments, its verdicts and its result file (canned runs),
plus one slow smoke run of the real thing with speculation off."""

from __future__ import annotations

import importlib.machinery
import itertools
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.frontend.bench.grounded_prompts import GROUNDED_PROMPTS
from scripts import bench_spec_decode as bench

REPO = Path(__file__).resolve().parents[2]


def test_defaults_follow_the_engine_and_the_issue():
    args = bench.parse_args([])
    engine = EngineConfig()
    assert (args.num_speculative_tokens, args.ngram_min, args.ngram_max) == (
        engine.num_speculative_tokens, engine.ngram_min, engine.ngram_max)
    assert args.workload_list == ["grounded", "random", "sampled", "concurrent", "llamacpp"]
    assert args.mode_list == ["off", "on"]
    assert (args.max_tokens, args.random_input_len, args.random_output_len, args.concurrency) == (
        256, 128, 128, 64)


@pytest.mark.parametrize("argv", [
    ["--workloads", "grounded,nope"], ["--modes", ""], ["--ngram-min", "3", "--ngram-max", "2"],
    ["--num-speculative-tokens", "0"], ["--num-prompts", "0"],
])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_children_rebuild_the_same_settings():
    argv = ["--num-speculative-tokens", "5", "--ngram-min", "1", "--ngram-max", "3",
            "--max-tokens", "8", "--num-prompts", "2", "--random-input-len", "16",
            "--random-output-len", "4", "--concurrency", "3", "--threads", "1", "--seed", "7",
            "--max-batch-tokens", "64", "--gguf", "/x.gguf", "--modes", "on"]
    parent = bench.parse_args(argv)
    child = bench.parse_args(bench.child_command("random", "on", parent)[2:])
    assert (child.run_one, child.run_mode) == ("random", "on")
    same = ("num_speculative_tokens", "ngram_min", "ngram_max", "max_tokens", "num_prompts",
            "random_input_len", "random_output_len", "concurrency", "threads", "seed",
            "max_batch_tokens", "gguf", "dtype", "model")
    assert {k: getattr(child, k) for k in same} == {k: getattr(parent, k) for k in same}


def test_engine_args_per_side():
    args = bench.parse_args(["--num-speculative-tokens", "4", "--ngram-min", "1"])
    off = bench.engine_args(args, "off", seqs=1, longest=300)
    on = bench.engine_args(args, "on", seqs=1, longest=300)
    assert "speculative_method" not in off and "max_num_batched_tokens" not in off
    assert (on["speculative_method"], on["num_speculative_tokens"], on["ngram_min"],
            on["ngram_max"]) == ("ngram", 4, 1, args.ngram_max)
    block = EngineConfig().block_size
    assert off["num_kv_blocks"] * block >= 300 and on["num_kv_blocks"] * block >= 300 + 5
    EngineConfig(**on)  # every name is an engine setting


def test_grounded_prompt_ids_use_the_chat_template(default_model):
    ids = bench.grounded_prompt_ids("default", 18)
    assert len(ids) == 18 and ids[16] == ids[0] and ids[0] != ids[1]
    from deepinfer.engine.tokenizer.tokenizer import Tokenizer

    text = Tokenizer(str(default_model)).decode(ids[0], skip_special_tokens=False)
    assert GROUNDED_PROMPTS[0] in text and text.startswith("<|im_start|>")


def test_batch1_runs_each_prompt_for_one_token_then_in_full():
    calls = []

    def generate(prompt: list[int], n: int) -> list[int]:
        calls.append((prompt[0], n))
        return [prompt[0]] * min(n, prompt[0])  # prompt [k] "answers" k tokens

    result = bench.time_batch1(generate, [[3], [1], [5]], max_tokens=4)
    assert calls == [(3, 1), (3, 4), (1, 1), (1, 4), (5, 1), (5, 4)]
    assert result["token_ids"] == [[3, 3, 3], [1], [5, 5, 5, 5]]
    assert (result["requests"], result["output_tokens"], result["decode_tokens"]) == (3, 8, 5)


class FakeLlama:
    """Stands in for llama_cpp.Llama: answers 7, 8, EOS, then would go on forever."""

    instances: list[FakeLlama] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.resets = kwargs, 0
        FakeLlama.instances.append(self)

    def token_eos(self) -> int:
        return 49000  # not the model's EOS: the script must stop at both

    def reset(self) -> None:
        self.resets += 1

    def generate(self, prompt, temp, top_k, reset):
        assert (temp, top_k, reset) == (0.0, 1, True)
        eos = EngineConfig().model_config().eos_token_ids[0]
        return itertools.chain([7, 8, eos], itertools.repeat(9))


def fake_llama_cpp(monkeypatch) -> None:
    root = types.ModuleType("llama_cpp")
    root.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    root.Llama = FakeLlama
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.LlamaPromptLookupDecoding = lambda **kw: ("lookup", kw)
    monkeypatch.setitem(sys.modules, "llama_cpp", root)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)


def test_llamacpp_side_on_the_grounded_prompts(monkeypatch, default_model):
    fake_llama_cpp(monkeypatch)
    FakeLlama.instances.clear()
    args = bench.parse_args(["--num-prompts", "2", "--max-tokens", "5", "--gguf", "/m.gguf",
                             "--num-speculative-tokens", "4", "--ngram-max", "3"])
    off, on = bench.run_llamacpp(args, "off"), bench.run_llamacpp(args, "on")
    eos = EngineConfig().model_config().eos_token_ids[0]
    assert off["token_ids"] == on["token_ids"] == [[7, 8, eos]] * 2  # EOS kept, then stop
    assert (off["decode_tokens"], off["gguf"]) == (2 * 2, "/m.gguf")
    lazy, looking = FakeLlama.instances
    assert "draft_model" not in lazy.kwargs
    assert looking.kwargs["draft_model"] == ("lookup", {"max_ngram_size": 3,
                                                        "num_pred_tokens": 4})
    assert looking.resets == 1 + 2 * 2  # warm-up, then each prompt's two runs start afresh


def run(ids: list[list[int]], tok_s: float, decode: float | None, drafts: int = 5) -> dict:
    return {"status": "ok", "token_ids": ids, "output_tok_s": tok_s, "decode_tok_s": decode,
            "requests": len(ids), "output_tokens": sum(map(len, ids)), "wall_s": 1.0, "spec": {
                "verify_steps": 1, "draft_tokens": drafts, "accepted_tokens": drafts // 2}}


CANNED = {  # the targets: grounded and random on decode tok/s, concurrent on output tok/s
    "grounded/off": run([[1, 2, 3], [4, 5]], 40.0, 50.0, drafts=0),
    "grounded/on": run([[1, 2, 3], [4, 5]], 60.0, 100.0),
    "random/off": run([[1, 2], [3, 4, 5]], 50.0, 60.0, drafts=0),
    "random/on": run([[1, 2], [3, 9, 5]], 40.0, 58.8),
    "sampled/off": run([[1, 4], [3, 4]], 50.0, 60.0, drafts=0),
    "sampled/on": run([[2, 4], [3, 5]], 49.0, 59.0),
    "concurrent/off": run([[7], [8]], 100.0, None, drafts=0),
    "concurrent/on": run([[7], [6]], 90.0, None, drafts=0),
    "llamacpp/off": {"status": "n/a", "reason": "llama_cpp not installed"},
    "llamacpp/on": {"status": "n/a", "reason": "llama_cpp not installed"},
}


def test_verdicts():
    comparison = bench.compare(CANNED)
    assert set(comparison) == {"grounded", "random", "sampled", "concurrent"}
    assert comparison["sampled"]["meets_target"] is True  # sampled text may differ: no FAIL
    assert comparison["grounded"]["on_over_off"] == {
        "output_tok_s": pytest.approx(1.5), "decode_tok_s": pytest.approx(2.0)}
    assert comparison["grounded"]["meets_target"] is True  # decode 2.0 >= 1.8
    assert comparison["random"]["meets_target"] is True  # decode 0.98 >= 0.95 (output: 0.8)
    assert comparison["concurrent"]["on_over_off"]["decode_tok_s"] is None
    assert comparison["concurrent"]["meets_target"] is False  # output 0.90 < 0.95
    assert comparison["random"]["first_difference"] == {
        "request": 1, "token": 1, "off_len": 3, "on_len": 3}
    assert comparison["grounded"]["first_difference"] is None
    # Batch-1 differences fail; a batched one is only reported.
    assert [line.split(":")[0] for line in bench.failures(comparison)] == ["FAIL random"]
    assert bench.first_difference([[1, 2]], [[1, 2, 3]]) == {
        "request": 0, "token": 2, "off_len": 2, "on_len": 3}
    assert any("concurrent/on: no draft tokens" in w for w in bench.warnings(CANNED))
    assert not any("grounded/off" in w for w in bench.warnings(CANNED))


def test_parent_report_and_result_file(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run_command(cmd, label, timeout, verbose, prefix):
        calls.append(cmd)
        assert prefix == bench.RESULT_PREFIX
        key = f"{label['workload']}/{label['mode']}"
        return {**label, **CANNED[key], "process_wall_s": 1.0, "other_load_cores": 0.0}

    monkeypatch.setattr(bench.peers, "run_command", fake_run_command)
    out = tmp_path / "spec.json"
    assert bench.main(["--result-file", str(out)]) == 1  # random's difference fails the run
    sides = [(c[c.index("--run-one") + 1], c[c.index("--run-mode") + 1]) for c in calls]
    assert sides[:3] == [("grounded", "off"), ("grounded", "on"), ("random", "off")]
    printed = capsys.readouterr().out
    assert printed.count("llama.cpp: not run (llama_cpp not installed)") == 1
    assert ("grounded: on/off output 1.50x, decode 2.00x (target: decode >= 1.80x, met); 2/2 "
            "outputs identical") in printed
    assert "concurrent: on/off output 0.90x (target: output >= 0.95x, NOT met)" in printed
    assert "FAIL random" in printed
    report = json.loads(out.read_text())
    assert set(report) == {"command", "settings", "environment", "results", "comparison",
                           "failures", "errors"}
    assert len(report["results"]) == 10 and report["errors"] == []
    assert all("token_ids" not in r for r in report["results"].values())
    assert report["comparison"]["grounded"]["on_over_off"]["decode_tok_s"] == pytest.approx(2.0)
    assert report["settings"]["num_speculative_tokens"] == EngineConfig().num_speculative_tokens
    assert report["failures"] and report["failures"][0].startswith("FAIL random")


@pytest.mark.slow
def test_smoke_run_with_speculation_off(default_model, tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_spec_decode.py", "--modes", "off",
         "--workloads", "grounded,random,concurrent", "--max-tokens", "8", "--num-prompts", "2",
         "--random-input-len", "16", "--random-output-len", "8", "--concurrency", "3",
         "--threads", "1", "--result-file", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["grounded/off", "random/off", "concurrent/off"]
    assert all(r["status"] == "ok" and r["output_tok_s"] > 0 for r in results.values())
    assert results["random/off"]["decode_tokens"] == 2 * 7  # the first token is not decode
    assert results["random/off"]["decode_tok_s"] > 0
    assert 2 <= results["grounded/off"]["output_tokens"] <= 16
    assert results["random/off"]["output_tokens"] == 2 * 8
    assert results["concurrent/off"]["output_tokens"] == 3 * 8
    assert "on/off" not in proc.stdout  # one side only: nothing to compare
