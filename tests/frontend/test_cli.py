"""The `deepinfer` command line: argument mapping and first-use model preparation."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend import cli


def test_serve_args_map_to_engine_config():
    args = cli.build_parser().parse_args([
        "serve", "--model", "/m", "--kv-cache-gb", "2.5", "--max-num-seqs", "8", "--port", "9",
        "--served-model-name", "x", "--max-pending", "3"])
    assert cli.engine_kwargs(args) == {"kv_cache_gb": 2.5, "max_num_seqs": 8,
                                       "served_model_name": "x"}
    assert (args.port, args.max_pending, args.host) == (9, 3, "127.0.0.1")
    assert cli.engine_config(args).model == "/m"


def test_generate_and_bench_args():
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--no-chat"])
    assert args.chat is False and args.temperature == 0.0
    args = cli.build_parser().parse_args(["bench", "serve", "--num-prompts", "3",
                                          "--goodput", "ttft:5"])
    assert args.num_prompts == 3 and args.goodput == ["ttft:5"]
    assert args.endpoint == "/v1/completions"


def test_default_model_prepared_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    script = tmp_path / "prepare.py"
    target = tmp_path / "cache" / cli.DEFAULT_MODEL_NAME / "model.safetensors"
    script.write_text(f"from pathlib import Path\np = Path({str(target)!r})\n"
                      "p.parent.mkdir(parents=True)\np.write_text('w')\n")
    monkeypatch.setattr(cli, "_PREPARE_SCRIPT", script)
    cli.ensure_model("/some/other/model")  # not the default: nothing to do
    assert not target.exists()
    cli.ensure_model("default")
    assert target.exists()
    cli.ensure_model("default")  # prepared: no second run


def test_missing_prepare_script_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(cli, "_PREPARE_SCRIPT", Path(tmp_path / "absent.py"))
    with pytest.raises(SystemExit) as exc:
        cli.ensure_model("default")
    assert "prepare_default_model" in str(exc.value)


def test_scripts_are_thin_wrappers():
    root = Path(__file__).resolve().parents[2]
    assert "frontend.cli import main" in (root / "scripts/launch_server.py").read_text()
    assert "frontend.bench.serving import main" in (root / "scripts/bench_serving.py").read_text()
