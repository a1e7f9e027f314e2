"""scripts/bench_quantization.py without running anything: its llama.cpp rows go through
llama-server with the same settings, and its ratios pair each format with its llama.cpp peer at
batch 1 and concurrently."""

from __future__ import annotations

from pathlib import Path

from scripts import bench_quantization as bq

GGUFS = {kind: Path(f"/w/m.{kind}.gguf") for kind in ("F32", "Q8_0", "Q4_1")}


def test_llama_cpp_rows_run_llama_server_on_each_gguf():
    rows = {label: (system, flags) for label, system, flags in bq.formats(GGUFS)}
    for kind in ("F32", "Q8_0", "Q4_1"):
        assert rows[f"llama.cpp {kind}"] == ("llama-server", ["--gguf", str(GGUFS[kind])])


def test_peer_args_carry_the_llama_server_settings():
    args = bq.parse_args(["--llama-server", "/x/llama-server", "--llama-server-slots", "8",
                          "--num-prompts", "4", "--threads", "2"])
    peer = bq.peer_args(args, "llama-server", ["--gguf", "/m.gguf"])
    assert (peer.system_list, peer.llama_server, peer.llama_server_slots, peer.gguf) == (
        ["llama-server"], "/x/llama-server", 8, "/m.gguf")
    assert (peer.num_prompts, peer.threads) == (4, 2)


def row(b1: float, batch: float) -> dict:
    return {"status": "ok", "batch1_decode_tok_s": b1, "batch_output_tok_s": batch}


def test_ratios_at_batch_1_and_concurrent():
    rows = {"deepinfer fp32": row(60, 600), "deepinfer int8": row(90, 900),
            "deepinfer GGUF Q4_1": row(100, 800), "llama.cpp F32": row(30, 300),
            "llama.cpp Q8_0": row(45, 300), "llama.cpp Q4_1": row(50, 400),
            "deepinfer GGUF Q8_0": {"status": "exit code 1"}}
    ratios = bq.compute_ratios(rows, num_prompts=64)
    assert ratios == {
        "fp32 / llama.cpp F32, batch-1": 2.0, "int8 / llama.cpp Q8_0, batch-1": 2.0,
        "GGUF Q4_1 / llama.cpp Q4_1, batch-1": 2.0, "fp32 / llama.cpp F32, 64 concurrent": 2.0,
        "int8 / llama.cpp Q8_0, 64 concurrent": 3.0,
        "GGUF Q4_1 / llama.cpp Q4_1, 64 concurrent": 2.0, "int8 / fp32, 64 concurrent": 1.5}


def test_alternate_ratios_follow_kv_cache_suffixes():
    medians = {"deepinfer int8 (KV float16)": 90.0, "deepinfer int8 (KV auto)": 45.0,
               "llama.cpp Q8_0": 45.0}
    assert bq.peer_ratios(medians, "batch-1") == {
        "int8 (KV float16) / llama.cpp Q8_0, batch-1": 2.0,
        "int8 (KV auto) / llama.cpp Q8_0, batch-1": 1.0}
