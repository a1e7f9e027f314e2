"""--device: what each value resolves to per rank, what is refused and how it is reported."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.engine.config import EngineConfig, ModelConfigError
from deepinfer.engine.runtime.launcher import EngineStartupError
from deepinfer.frontend import cli
from deepinfer.workers.cuda_graphs import capture_sizes
from deepinfer.workers.device import DeviceError, resolve_device


@pytest.fixture
def two_gpus(monkeypatch):
    """torch as a machine with two GPUs would answer (no CUDA call is made to resolve)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_cpu_and_auto_without_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cpu", "auto"):
        assert resolve_device(EngineConfig(device=device), 0) == torch.device("cpu")
    with pytest.raises(DeviceError, match="--device cuda: torch .* sees no CUDA device"):
        resolve_device(EngineConfig(device="cuda"), 0)


@pytest.mark.parametrize("tp,nnodes,rank,gpu", [(1, 1, 0, 0), (2, 1, 1, 1), (4, 2, 3, 1),
                                                (4, 1, 3, 1)])  # 4 ranks on 2 GPUs wrap
def test_ranks_take_their_nodes_gpus_in_order(two_gpus, tp, nnodes, rank, gpu) -> None:
    config = EngineConfig(device="auto", tensor_parallel_size=tp, nnodes=nnodes)
    assert resolve_device(config, rank) == torch.device("cuda", gpu)
    assert resolve_device(EngineConfig(device="cpu", tensor_parallel_size=tp), rank).type == "cpu"


def test_auto_on_a_gpu_refuses_what_runs_on_cpu_only(two_gpus) -> None:
    with pytest.raises(DeviceError, match="--quantization int8 runs on CPU workers only.*"
                                          "--device cpu"):
        resolve_device(EngineConfig(device="auto", quantization="int8"), 0)


@pytest.mark.parametrize("settings,problem", [
    ({"device": "gpu"}, "--device must be one of auto, cpu, cuda, not 'gpu'"),
    ({"device": "cuda", "quantization": "fp8"}, "--device cuda: --quantization fp8 runs on CPU"),
    ({"device": "cuda", "speculative_method": "mtp"}, "--device cuda: --speculative-method mtp"),
    ({"device": "cuda", "disaggregation_mode": "prefill"}, "--device cuda: --disaggregation"),
])
def test_config_refuses_before_any_process_starts(settings, problem) -> None:
    with pytest.raises(ModelConfigError, match=problem.replace("(", r"\(")):
        EngineConfig(**settings).check_device()
    EngineConfig(device="cuda", speculative_method="ngram").check_device()  # either device


def test_cli_takes_the_three_values(capsys) -> None:
    parse = cli.build_parser().parse_args
    assert cli.engine_kwargs(parse(["serve", "--device", "cuda"]))["device"] == "cuda"
    assert "device" not in cli.engine_kwargs(parse(["serve"]))  # the config's auto
    with pytest.raises(SystemExit):
        parse(["serve", "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU refuses cuda")
def test_cuda_without_a_gpu_fails_the_start_with_the_reason(tiny_model_dir) -> None:
    """The worker finds out (the API server and scheduler never import torch) and the start
    fails with its sentence, not a hang."""
    with pytest.raises(EngineStartupError, match="worker0 failed to start: DeviceError: "
                                                 "--device cuda: torch .* sees no CUDA device"):
        LLM(str(tiny_model_dir), device="cuda", num_kv_blocks=16)


def test_graph_sizes_and_the_eager_switch() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1000)[-1] == 256
    parse = cli.build_parser().parse_args
    assert cli.engine_kwargs(parse(["serve", "--enforce-eager"]))["enforce_eager"] is True
    assert cli.engine_config(parse(["generate", "--prompt", "x"])).enforce_eager is False


def test_quantized_checkpoints_are_refused_off_the_cpu(tiny_model_dir, tmp_path) -> None:
    """An fp8 checkpoint keeps its weights quantized; off the CPU (here the meta device, which
    needs no GPU: the check runs before anything moves) the loader says so."""
    from deepinfer.workers.loader import load_model
    from tests.workers.quantization.quantized_checkpoints import write_fp8_checkpoint

    fp8, _ = write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", tmp_path / "ref")
    with pytest.raises(ModelConfigError, match="keeps quantized weights .* run on CPU workers "
                                               "only so far: --device cpu"):
        load_model(str(fp8), device=torch.device("meta"))
