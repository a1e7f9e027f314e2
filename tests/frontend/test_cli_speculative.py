"""Speculative decoding settings: the CLI flags, their checks (EngineConfig.check_speculative,
model_store.ensure_config) and the one-line errors of `deepinfer serve` / `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.engine import model_store
from deepinfer.engine.config import DEFAULT_MODEL_NAME, EngineConfig, ModelConfigError
from deepinfer.engine.runtime.llm import LLM
from deepinfer.frontend import cli
from deepinfer.frontend.server import server
from tests.engine.model_store.tiny_gguf import use_tiny_default_model

SPEC_FLAGS = ["--speculative-method", "draft", "--num-speculative-tokens", "5",
              "--speculative-model", "/d", "--ngram-min", "1", "--ngram-max", "3",
              "--speculative-disable-by-batch-size", "8"]


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"]])
def test_spec_flags_map_to_engine_config(command):
    args = cli.build_parser().parse_args(command + SPEC_FLAGS)
    assert cli.engine_kwargs(args) == {
        "speculative_method": "draft", "num_speculative_tokens": 5, "speculative_model": "/d",
        "ngram_min": 1, "ngram_max": 3, "speculative_disable_by_batch_size": 8}


def test_dspark_flags_map_to_engine_config():
    args = cli.build_parser().parse_args(["serve", "--speculative-method", "dspark",
                                          "--speculative-model", "/d",
                                          "--speculative-confidence-threshold", "0.25"])
    assert cli.engine_kwargs(args) == {"speculative_method": "dspark", "speculative_model": "/d",
                                       "speculative_confidence_threshold": 0.25}


def test_unset_spec_flags_keep_speculation_off():
    config = cli.engine_config(cli.build_parser().parse_args(["serve"]))
    assert config.speculative_method is None and config.num_speculative_tokens == 3
    config.check_speculative()


def test_unknown_method_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["serve", "--speculative-method", "eagle"])
    assert exc.value.code == 2
    assert "invalid choice: 'eagle'" in capsys.readouterr().err


@pytest.mark.parametrize("settings", [
    {},
    {"speculative_method": "ngram", "num_speculative_tokens": 1, "ngram_min": 1, "ngram_max": 1},
    {"speculative_method": "mtp", "num_speculative_tokens": 16},
    {"speculative_method": "draft", "speculative_model": "/d"},
    {"speculative_method": "dspark", "speculative_model": "/d"},
    {"speculative_method": "dspark", "speculative_model": "/d",
     "speculative_confidence_threshold": 0.0},
    {"speculative_method": "dspark", "speculative_model": "/d",
     "speculative_confidence_threshold": 1.0},
    {"speculative_method": "ngram", "speculative_disable_by_batch_size": 1},
    {"num_speculative_tokens": 0},  # ignored while speculation is off
])
def test_valid_settings_pass(settings):
    EngineConfig(**settings).check_speculative()


@pytest.mark.parametrize("settings,message", [
    ({"speculative_method": "eagle"},
     "--speculative-method must be one of ngram, draft, mtp, dspark"),
    ({"speculative_method": "dspark"}, "--speculative-method dspark needs --speculative-model"),
    ({"speculative_method": "mtp", "speculative_confidence_threshold": 0.5},
     "--speculative-confidence-threshold is a probability for --speculative-method dspark"),
    ({"speculative_method": "dspark", "speculative_model": "/d",
      "speculative_confidence_threshold": 1.5},
     "--speculative-confidence-threshold is a probability"),
    ({"speculative_method": "dspark", "speculative_model": "/d",
      "speculative_confidence_threshold": -0.1},
     "--speculative-confidence-threshold must be at least 0"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0},
     "--num-speculative-tokens must be between 1 and 16, got 0"),
    ({"speculative_method": "mtp", "num_speculative_tokens": 17},
     "--num-speculative-tokens must be between 1 and 16, got 17"),
    ({"ngram_min": 0}, "--ngram-min must be at least 1, got 0"),
    ({"ngram_min": 5, "ngram_max": 4}, r"--ngram-min \(5\) must not exceed --ngram-max \(4\)"),
    ({"speculative_method": "draft"}, "--speculative-method draft needs --speculative-model"),
    ({"speculative_model": "/d"}, "--speculative-model is only used with --speculative-method"),
    ({"speculative_method": "ngram", "speculative_model": "/d"},
     "--speculative-model is only used with --speculative-method draft"),
    ({"speculative_method": "ngram", "speculative_disable_by_batch_size": 0},
     "--speculative-disable-by-batch-size must be at least 1, got 0"),
])
def test_invalid_settings_name_the_flag(settings, message):
    with pytest.raises(ModelConfigError, match=message):
        EngineConfig(**settings).check_speculative()


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"]])
def test_settings_are_checked_before_the_model(command, tmp_path, capsys):
    # The model does not exist: the settings' error comes first (a typo costs no download).
    code = cli.main(command + ["--model", str(tmp_path / "absent"), "--speculative-method",
                               "ngram", "--num-speculative-tokens", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("deepinfer: error: --num-speculative-tokens must be between 1 and 16")


def test_offline_llm_checks_the_settings(tmp_path):
    with pytest.raises(ModelConfigError, match="--ngram-min"):
        LLM(str(tmp_path / "absent"), ngram_min=3, ngram_max=2)


@pytest.fixture()
def tiny_default(tmp_path, monkeypatch) -> Path:
    """'default' is a tiny model prepared on first use (no network)."""
    return use_tiny_default_model(tmp_path / "cache", monkeypatch)


@pytest.fixture()
def served(monkeypatch) -> list[EngineConfig]:
    """The configs `deepinfer serve` would have started an engine with."""
    configs: list[EngineConfig] = []
    monkeypatch.setattr(server, "serve", lambda config, *a, **kw: configs.append(config) or 0)
    return configs


def last_line(capsys) -> str:
    lines = capsys.readouterr().err.splitlines()  # preparing a model logs progress first
    return lines[-1]


def test_draft_model_directory_is_checked_like_the_model(tiny_default, served, tmp_path,
                                                         capsys):
    (tmp_path / "empty").mkdir()
    for draft in ("absent", "empty"):
        code = cli.main(["serve", "--speculative-method", "draft",
                         "--speculative-model", str(tmp_path / draft)])
        assert code == 1 and not served
        err = last_line(capsys)
        assert err.startswith("deepinfer: error: --speculative-model: ") and draft in err


def test_draft_model_is_resolved_to_its_directory(tiny_default, served):
    assert cli.main(["serve", "--speculative-method", "draft", "--speculative-model",
                     "default", "--num-speculative-tokens", "2"]) == 0
    (config,) = served
    # A named draft model is prepared like --model and handed to the engine as a directory.
    assert config.speculative_model == str(tiny_default / DEFAULT_MODEL_NAME)
    assert (config.model, config.num_speculative_tokens) == ("default", 2)
    model_store.check_model_dir(config.speculative_model)
