"""The `deepinfer` command line: argument mapping, first-use model preparation, one-line errors."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from deepinfer.engine import model_store
from deepinfer.engine.config import ModelConfigError
from deepinfer.frontend import cli
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.state import ServerState
from scripts.tiny_models import save_tiny_model
from tests.engine.model_store.tiny_gguf import use_tiny_default_model


def test_serve_args_map_to_engine_config():
    args = cli.build_parser().parse_args([
        "serve", "--model", "/m", "--kv-cache-gb", "2.5", "--max-num-seqs", "8", "--port", "9",
        "--served-model-name", "x", "--max-pending", "3", "--kv-cache-dtype", "float16"])
    assert cli.engine_kwargs(args) == {"kv_cache_gb": 2.5, "max_num_seqs": 8,
                                       "served_model_name": ["x"], "kv_cache_dtype": "float16"}
    assert (args.port, args.max_pending, args.host) == (9, 3, "127.0.0.1")
    assert cli.engine_config(args).model == "/m"


def test_several_served_model_names_and_a_pattern():
    """The first name is the model's; the others, and patterns, are aliases (Claude Code names
    Claude models: 'claude-*' maps them to the served one)."""
    args = cli.build_parser().parse_args([
        "serve", "--model", "/m", "--served-model-name", "s", "other", "claude-*"])
    config = cli.engine_config(args)
    assert (config.model_name(), config.model_aliases()) == ("s", ("/m", "other", "claude-*"))
    state = ServerState(max_pending=1, model_aliases=config.model_aliases())
    for name in ("other", "claude-haiku-4-5-20251001", "claude-opus-4-8", "/m"):
        assert state.check_model(name) is None
    for name in ("claude", "gpt-4", "xclaude-1"):
        with pytest.raises(APIError):
            state.check_model(name)
    state.lora_adapters["claude-lora"] = "/adapter"  # its own name beats the pattern
    assert state.check_model("claude-lora") == "claude-lora"


def test_a_kv_cache_dtype_typo_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    assert "--kv-cache-dtype: invalid choice: 'fp4'" in capsys.readouterr().err


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


@pytest.mark.parametrize("argv,problem", [
    (["router", "--prefill", "http://p"], "--prefill and --decode go together"),
    (["router", "--decode", "http://d"], "--prefill and --decode go together"),
    (["router"], "give --worker URL"),
    (["router", "--worker", "http://w", "--prefill", "http://p", "--decode", "http://d"],
     "two modes"),
    (["router", "--prefill", "http://s/", "--decode", "http://s"], "not both"),
    (["serve", "--prefill-servers", "1", "--decode-servers", "0"], "go together"),
    (["serve", "--decode-servers", "2"], "go together"),
    (["serve", "--prefill-servers", "1", "--decode-servers", "1", "--data-parallel-size", "2"],
     "two topologies"),
])
def test_router_and_serve_refuse_half_a_topology(argv, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and problem in err.splitlines()[-1]
    assert err.splitlines()[-1].startswith("deepinfer: error: ")


def test_router_modes_parse(monkeypatch):
    monkeypatch.setenv("DEEPINFER_CLUSTER_SECRET", "s")
    parse = cli.build_parser().parse_args
    pd = parse(["router", "--prefill", "http://p1", "--prefill", "http://p2", "--decode",
                "http://d", "--port", "9"])
    assert (pd.prefill, pd.decode, pd.worker, pd.port) == (["http://p1", "http://p2"],
                                                           ["http://d"], None, 9)
    dp = parse(["router", "--worker", "http://a", "--worker", "http://b"])
    assert cli.usage_problem(pd) is None and cli.usage_problem(dp) is None
    serve = parse(["serve", "--prefill-servers", "1", "--decode-servers", "2"])
    assert cli.usage_problem(serve) is None and cli.usage_problem(parse(["serve"])) is None
    monkeypatch.delenv("DEEPINFER_CLUSTER_SECRET")
    assert "DEEPINFER_CLUSTER_SECRET" in cli.usage_problem(pd)  # its servers authenticate it


def test_the_cluster_secret_comes_from_a_file_and_reaches_the_processes(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.delenv("DEEPINFER_CLUSTER_SECRET", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    monkeypatch.setattr(cli, "_router", lambda args: 0)
    assert cli.main(["router", "--prefill", "http://p", "--decode", "http://d",
                     "--cluster-secret-file", str(secret)]) == 0
    assert os.environ["DEEPINFER_CLUSTER_SECRET"] == "from-a-file"  # children inherit it
    secret.write_text("")
    with pytest.raises(SystemExit):
        cli.main(["router", "--prefill", "http://p", "--decode", "http://d",
                  "--cluster-secret-file", str(secret)])
    assert "is empty" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--disaggregation-mode", "decode"],
                                   ["--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"]])
def test_servers_that_talk_to_peers_need_the_cluster_secret(monkeypatch, tmp_path, flags):
    monkeypatch.delenv("DEEPINFER_CLUSTER_SECRET", raising=False)
    model = save_tiny_model(tmp_path / "tiny")
    config = cli.engine_config(cli.build_parser().parse_args(["serve", "--model", str(model),
                                                              "--tensor-parallel-size", "2",
                                                              *flags]))
    with pytest.raises(ModelConfigError, match="needs the cluster secret"):
        config.check_disaggregation()
        config.check_parallel()


@pytest.fixture()
def started(monkeypatch):
    """`deepinfer serve` topologies with no process started: the argv of each local server
    and the router's arguments."""
    from deepinfer.frontend.router import server

    seen: dict = {"argvs": [], "configs": []}
    # A disaggregated topology makes its own secret for its processes: not for later tests.
    monkeypatch.delenv("DEEPINFER_CLUSTER_SECRET", raising=False)

    @contextlib.contextmanager
    def local_servers(argvs, api_key, start_timeout):
        seen["argvs"] = argvs
        yield [f"http://127.0.0.1:{9000 + i}" for i in range(len(argvs))]

    def ensure_config(config):
        seen["configs"].append(config)
        return config

    monkeypatch.setattr(model_store, "ensure_config", ensure_config)
    monkeypatch.setattr(server, "local_servers", local_servers)
    monkeypatch.setattr(server, "run_pd_router", lambda *a, **k: seen.setdefault("pd", a) and 0)
    monkeypatch.setattr(server, "run_router", lambda *a, **k: seen.setdefault("dp", a) and 0)
    return seen


def flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_serve_prefill_and_decode_servers_each_get_their_role(started):
    assert cli.main(["serve", "--model", "/m", "--prefill-servers", "1", "--decode-servers", "2",
                     "--disaggregation-mode", "decode", "--kv-hold-timeout", "7",
                     "--worker-threads", "3", "--no-overlap-scheduling", "--port", "8"]) == 0
    # Checked as a server with a role is (so the prefix-cache requirement is caught up front).
    assert started["configs"][0].disaggregation_mode == "prefill"
    argvs = started["argvs"]
    assert [flag(a, "--disaggregation-mode") for a in argvs] == [["prefill"], ["decode"],
                                                                ["decode"]]
    assert all(flag(a, "--worker-threads") == ["3"] and flag(a, "--kv-hold-timeout") == ["7.0"]
               and flag(a, "--model") == ["/m"] and "--no-overlap-scheduling" in a
               for a in argvs)
    prefill, decode, host, port = started["pd"][:4]
    assert (prefill, decode, host, port) == (["http://127.0.0.1:9000"],
                                             ["http://127.0.0.1:9001", "http://127.0.0.1:9002"],
                                             "127.0.0.1", 8)
    # A fresh cluster secret, passed to the servers by their environment (not their argv).
    assert len(os.environ["DEEPINFER_CLUSTER_SECRET"]) == 64
    assert not any(os.environ["DEEPINFER_CLUSTER_SECRET"] in " ".join(a) for a in argvs)


def test_serve_data_parallel_shares_the_cores_over_its_replicas(started, monkeypatch):
    from deepinfer.frontend.router import server

    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert cli.main(["serve", "--model", "/m", "--data-parallel-size", "4"]) == 0
    argvs = started["argvs"]
    assert len(argvs) == 4 and all(a == argvs[0] for a in argvs)
    assert flag(argvs[0], "--worker-threads") == ["2"]
    assert "--disaggregation-mode" not in argvs[0] and len(started["dp"][0]) == 4


def test_serve_prefill_and_decode_servers_need_the_prefix_cache_before_any_start(capsys):
    assert cli.main(["serve", "--prefill-servers", "1", "--decode-servers", "1",
                     "--no-enable-prefix-caching"]) == 1
    assert "needs the prefix cache" in capsys.readouterr().err


def test_serve_data_parallel_with_kv_events_ranks_its_replicas_for_the_router(started,
                                                                              monkeypatch):
    from deepinfer.frontend.router import server

    routed = {}
    monkeypatch.setattr(server, "run_router", lambda *a, **k: routed.update(k) or 0)
    events = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'
    assert cli.main(["serve", "--model", "/m", "--data-parallel-size", "2",
                     "--kv-events-config", events]) == 0
    argvs = started["argvs"]
    assert [flag(a, "--data-parallel-rank") for a in argvs] == [["0"], ["1"]]
    assert all(flag(a, "--kv-events-config") == [events] for a in argvs)
    config, model_dir = routed["kv_events"]
    assert config.endpoint == "tcp://*:6000" and model_dir == "/m"


@pytest.mark.parametrize("argv,problem", [
    (["router", "--worker", "http://w", "--kv-events", "{}"], "needs --tokenizer"),
    (["serve", "--kv-events-config", "{bad"], "--kv-events-config must be a JSON object"),
    (["serve", "--data-parallel-size", "2", "--kv-events-config",
      '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
      '"replay_endpoint": "tcp://*:5558"}'], "at least 2 apart"),
])
def test_kv_events_flags_are_checked_up_front(argv, problem, capsys):
    code = None
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code in (1, 2) and problem in capsys.readouterr().err
