"""The `deepinfer` command line: argument mapping, first-use model preparation, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import model_store
from engine.config import ModelConfigError
from frontend import cli
from tests.engine.model_store.tiny_gguf import use_tiny_default_model


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


@pytest.fixture()
def tiny_default(tmp_path, monkeypatch) -> Path:
    return use_tiny_default_model(tmp_path / "cache", monkeypatch)


def test_default_model_prepared_on_first_use(tiny_default, tmp_path, capfd):
    target = tiny_default / cli.DEFAULT_MODEL_NAME
    model = tmp_path / "other"
    with pytest.raises(ModelConfigError, match="does not exist"):
        model_store.ensure_model(str(model))  # not a named model: checked, not prepared
    assert not target.exists()
    assert model_store.ensure_model("default") == "default"  # engine.config resolves it
    assert model_store.is_prepared(target)
    assert "dequantizing" in capfd.readouterr().err  # progress on stderr
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert model_store.ensure_model(cli.DEFAULT_MODEL_NAME) == cli.DEFAULT_MODEL_NAME
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # prepared: no second run


def test_prepare_model_command(tiny_default, capsys):
    assert cli.main(["prepare-model"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tiny_default / cli.DEFAULT_MODEL_NAME)
    assert model_store.is_prepared(tiny_default / cli.DEFAULT_MODEL_NAME)
    assert cli.main(["prepare-model", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error: no model named 'nope'") and err.count("\n") == 1


def test_missing_model_errors_name_prepare_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    with pytest.raises(ModelConfigError, match="deepinfer prepare-model"):
        model_store.check_model_dir(tmp_path / cli.DEFAULT_MODEL_NAME)
    assert cli.main(["generate", "--model", str(tmp_path / "absent"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error:") and "prepare-model" in err


def test_scripts_are_thin_wrappers():
    root = Path(__file__).resolve().parents[2]
    assert "frontend.cli import main" in (root / "scripts/launch_server.py").read_text()
    assert "frontend.bench.serving import main" in (root / "scripts/bench_serving.py").read_text()
    prepare = (root / "scripts/prepare_default_model.py").read_text()
    assert "frontend.cli import main" in prepare and "prepare-model" in prepare
