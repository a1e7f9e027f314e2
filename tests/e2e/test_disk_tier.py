"""The disk tier through the real processes (engine/kvcache/connectors/disk_tier.py): blocks
outlive the server, other servers of the same model find them in a shared directory, and what
is read back computes what a cold run computes. Faults: damaged files, a server killed mid-write,
a full disk, an unusable directory, two models in one directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from scripts.server_process import ServerProcess
from scripts.tiny_models import save_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
W = 8


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 40000, n).tolist()


def cold(model_dir, tokens, params: SamplingParams = GREEDY, **kw):
    with LLM(str(model_dir), num_kv_blocks=200, block_size=4, enable_prefix_caching=False,
             **kw) as llm:
        return llm.generate([tokens], params)[0]


def max_logprob_gap(a, b) -> float:
    return max(abs(x.chosen.logprob - y.chosen.logprob) for x, y in zip(a.logprobs, b.logprobs))


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


# ---------------------------------------------------------------------- restart, per model

@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid", "deepseek-v4"])
def model(request, tiny_model_dir, tmp_path_factory):
    """(model, whether it has sliding windows): Llama; a Qwen3 hybrid (two sliding layers of
    four, W = 8); DeepSeek-V4 (every layer has a window, CSA and HCA compressed entries)."""
    if request.param == "llama":
        return tiny_model_dir, False
    if request.param == "deepseek-v4":
        return save_tiny_model(tmp_path_factory.mktemp("v4"), "deepseek_v4"), True
    return save_tiny_model(
        tmp_path_factory.mktemp("hybrid"), "qwen3", num_hidden_layers=4, sliding_window=W,
        use_sliding_window=True, layer_types=["sliding_attention", "full_attention",
                                              "sliding_attention", "full_attention"]), True


@pytest.mark.parametrize("shared", [0, 6], ids=["at_a_snapshot", "past_a_snapshot"])
def test_a_restarted_engine_reads_the_prefix_from_disk_as_a_cold_run_computes_it(
        model, shared, tmp_path):
    """The second prompt shares 10 W + `shared` tokens with the first: its hit ends at a
    snapshot saved inside the first (every W), or past one, from which the sliding layers
    replay; either way what a cold run computes (default replay mode)."""
    model_dir, sliding = model
    first = prompt(12 * W, seed=3)
    second = first[:10 * W + shared] + prompt(5, seed=4)
    with LLM(str(model_dir), num_kv_blocks=200, block_size=4, kv_disk_path=str(tmp_path)) as llm:
        assert llm.generate([first], GREEDY)[0].cached_tokens == 0
    assert block_files(tmp_path)
    with LLM(str(model_dir), num_kv_blocks=200, block_size=4,
             kv_disk_path=str(tmp_path)) as llm:  # a new engine: its device cache is empty
        again = llm.generate([second], GREEDY)[0]
        stats = llm.stats()
    hit = (10 * W + shared) // 4 * 4
    assert again.cached_tokens == hit and stats.disk_hit_tokens == hit
    if sliding:  # resumed from a snapshot read from disk: at most the tokens since it replay
        assert stats.swa_snapshot_hits == 1 and stats.replayed_tokens == hit - 10 * W
    ref = cold(model_dir, second)
    assert again.token_ids == ref.token_ids and max_logprob_gap(again, ref) < 1e-4


# ---------------------------------------------------------------------- servers sharing a DIR

def serve(model_dir, root: Path, *args: str) -> ServerProcess:
    return ServerProcess(model_dir, "--kv-disk-path", str(root), "--num-kv-blocks", "256",
                         "--served-model-name", "tiny", *args)


def complete(server: ServerProcess, tokens: list[int], **extra) -> dict:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0, "logprobs": 1,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def wait_written(server: ServerProcess, blocks: int) -> None:
    """Until the server's writer has put `blocks` blocks on disk (it writes off the step)."""
    deadline = time.monotonic() + 60
    while metrics(server)['deepinfer_kv_tier_written_bytes_total{tier="disk"}'] < blocks * 1000:
        assert time.monotonic() < deadline, "the blocks never reached disk"
        time.sleep(0.05)


def logprobs(answer: dict) -> list[float]:
    return answer["choices"][0]["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def shared(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-kv")
    a, b = serve(tiny_model_dir, root), serve(tiny_model_dir, root)
    try:
        yield root, a, b
    finally:
        a.stop()
        b.stop()


def test_a_live_server_reads_the_blocks_another_one_wrote(shared):
    root, a, b = shared
    tokens = prompt(130, seed=10)
    cold_answer = complete(a, tokens)
    wait_written(a, 130 // 16)
    answer = complete(b, tokens)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    assert metrics(b)['deepinfer_kv_tier_hit_tokens_total{tier="disk"}'] >= 128
    assert answer["choices"][0]["text"] == cold_answer["choices"][0]["text"]
    assert np.allclose(logprobs(answer), logprobs(cold_answer), atol=1e-4)


def test_a_cache_salt_keeps_a_tenants_prefix_to_itself_on_every_server(shared, tiny_model_dir):
    """cached_tokens tells a client what is cached: with a salt, only requests of the same
    salt see a prompt's blocks, on the server that computed them and from the shared disk."""
    from deepinfer.engine.config import EngineConfig

    root, a, b = shared
    tokens = prompt(70, seed=40)
    block = EngineConfig(model=str(tiny_model_dir)).kv_bytes_per_block()

    def written() -> float:
        return metrics(a)['deepinfer_kv_tier_written_bytes_total{tier="disk"}']

    def cached(server: ServerProcess, **salt) -> int:
        return complete(server, tokens, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    before = written()
    assert cached(a, cache_salt="tenant-a") == 0
    assert cached(a, cache_salt="tenant-b") == 0 and cached(a) == 0
    assert cached(a, cache_salt="tenant-a") == 64
    deadline = time.monotonic() + 60
    while written() < before + 3 * 4 * block:  # the three prompts' blocks, on disk
        assert time.monotonic() < deadline, "the blocks never reached disk"
        time.sleep(0.05)
    assert cached(b, cache_salt="tenant-c") == 0
    assert cached(b, cache_salt="tenant-a") == 64  # read from the disk a wrote


def test_a_damaged_file_is_counted_deleted_and_recomputed(shared):
    root, a, b = shared
    tokens = prompt(100, seed=11)
    cold_answer = complete(a, tokens)
    wait_written(a, 2 * 100 // 16)  # this prompt's blocks, beyond those already written
    before = {p: p.stat().st_mtime_ns for p in block_files(root)}
    # Damage every file of this prompt in a different way: b must read none of them.
    mine = [p for p in before if p.stat().st_mtime_ns >= max(before.values()) - 5 * 10**9]
    for i, path in enumerate(mine):
        data = path.read_bytes()
        damaged = [data[:-7], data[:40] + b"\x00" * 32 + data[72:],
                   data[:-1] + bytes([data[-1] ^ 0xFF])][i % 3]
        path.write_bytes(damaged)
    corrupt_before = metrics(b)["deepinfer_kv_disk_corrupt_blocks_total"]
    answer = complete(b, tokens)
    assert metrics(b)["deepinfer_kv_disk_corrupt_blocks_total"] > corrupt_before
    assert answer["choices"][0]["text"] == cold_answer["choices"][0]["text"]
    assert np.allclose(logprobs(answer), logprobs(cold_answer), atol=1e-4)


# ---------------------------------------------------------------------- faults

def test_a_server_killed_mid_write_leaves_nothing_a_restart_would_use(tiny_model_dir, tmp_path):
    tokens = [prompt(200, seed=20 + i) for i in range(6)]
    server = serve(tiny_model_dir, tmp_path)
    try:
        complete(server, tokens[0])
        stop = threading.Event()

        def load():
            with contextlib.suppress(httpx.HTTPError):
                for t in tokens[1:]:
                    if stop.is_set():
                        return
                    complete(server, t)

        thread = threading.Thread(target=load)
        thread.start()
        while metrics(server)['deepinfer_kv_tier_written_bytes_total{tier="disk"}'] < 20000:
            time.sleep(0.01)
    finally:
        os.killpg(server.proc.pid, signal.SIGKILL)  # every process at once, writes in flight
        server.proc.wait(10)
        stop.set()
        thread.join(60)
    # A torn file of the first prompt's, as a crash of the machine could leave one despite
    # the rename.
    victim = min(block_files(tmp_path), key=lambda p: p.stat().st_mtime_ns)
    victim.write_bytes(victim.read_bytes()[:100])
    server = serve(tiny_model_dir, tmp_path)
    try:
        for t in tokens[:2]:
            answer = complete(server, t)
            ref = cold(tiny_model_dir, t, SamplingParams(max_tokens=4, temperature=0.0,
                                                         ignore_eos=True))
            assert answer["choices"][0]["text"] == ref.text
        assert metrics(server)["deepinfer_kv_disk_corrupt_blocks_total"] == 1
    finally:
        server.stop()


def _mount_tmpfs(where: Path, options: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True,
                   capture_output=True)


def _can_mount() -> bool:
    """Whether this machine lets us mount a tmpfs (root with the capability to)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as probe:
        try:
            _mount_tmpfs(Path(probe), "size=4k")
        except (OSError, subprocess.CalledProcessError):
            return False
        subprocess.run(["umount", probe], check=False)
    return True


needs_mount = pytest.mark.skipif(not _can_mount(),
                                 reason="a small tmpfs (a full disk, a read-only one) needs root")


@needs_mount
def test_a_full_disk_stops_writes_with_a_warning_and_serving_goes_on(tiny_model_dir, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    _mount_tmpfs(small, "size=128k")  # room for about ten blocks of the tiny model
    try:
        server = serve(tiny_model_dir, small)
        try:
            for i in range(4):
                answer = complete(server, prompt(200, seed=30 + i))
                assert answer["usage"]["completion_tokens"] == 4
            deadline = time.monotonic() + 30
            while "cannot write" not in server.output():
                assert time.monotonic() < deadline, server.output()
                time.sleep(0.1)
            # What it failed to write it does not count on: what it knows is what is there.
            used = metrics(server)["deepinfer_kv_disk_blocks_used"]
            assert 0 < used <= len(block_files(small)) + 1
            assert httpx.get(f"{server.base_url}/health").status_code == 200
        finally:
            server.stop()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def _serve_fails(model_dir, root: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer", "serve", "--model", str(model_dir),
         "--kv-disk-path", str(root), "--port", "1"], capture_output=True, text=True,
        timeout=120, cwd=tempfile.gettempdir())
    assert out.returncode != 0
    return out.stderr


def test_a_missing_directory_is_a_clear_start_up_error(tiny_model_dir, tmp_path):
    assert "--kv-disk-path" in _serve_fails(tiny_model_dir, tmp_path / "nowhere")


@needs_mount
def test_a_read_only_directory_is_a_clear_start_up_error(tiny_model_dir, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    _mount_tmpfs(ro, "ro,size=64k")
    try:
        err = _serve_fails(tiny_model_dir, ro)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert "--kv-disk-path" in err and "cannot write" in err


def test_two_models_in_one_directory_never_share_a_block(tiny_model_dir, tmp_path):
    other = save_tiny_model(tmp_path / "other", tokenizer_from=tiny_model_dir, seed=1)
    # Same directory name, same architecture: only the weights differ.
    same_name = tmp_path / "b" / tiny_model_dir.name
    os.makedirs(same_name.parent)
    os.symlink(other, same_name)
    tokens = prompt(90, seed=40)
    (tmp_path / "kv").mkdir()
    with LLM(str(tiny_model_dir), num_kv_blocks=200, block_size=4,
             kv_disk_path=str(tmp_path / "kv")) as llm:
        llm.generate([tokens], GREEDY)
    with LLM(str(same_name), num_kv_blocks=200, block_size=4,
             kv_disk_path=str(tmp_path / "kv")) as llm:
        out = llm.generate([tokens], GREEDY)[0]
        assert out.cached_tokens == 0 and llm.stats().disk_hit_tokens == 0
    assert len(list((tmp_path / "kv").iterdir())) == 2  # one folder per model
    assert out.token_ids == cold(other, tokens).token_ids


@pytest.mark.slow  # tensor parallelism x the disk tier: both are tested alone in `make test`
def test_each_tensor_parallel_rank_keeps_its_own_share(tiny_model_dir, tmp_path):
    tokens = prompt(70, seed=50)
    kw = dict(num_kv_blocks=200, block_size=4, kv_disk_path=str(tmp_path),
              tensor_parallel_size=2)
    with LLM(str(tiny_model_dir), **kw) as llm:
        llm.generate([tokens], GREEDY)
    ranks = sorted(p.name for p in next(tmp_path.iterdir()).iterdir())
    assert ranks == ["rank0", "rank1"]
    with LLM(str(tiny_model_dir), **kw) as llm:
        again = llm.generate([tokens], GREEDY)[0]
        assert llm.stats().disk_hit_tokens == 68
    ref = cold(tiny_model_dir, tokens, tensor_parallel_size=2)
    assert again.token_ids == ref.token_ids and max_logprob_gap(again, ref) < 1e-4
