"""The soak test's short version (scripts/soak.py runs the long one): 300 requests at 32 at once
against a real server on a tiny model: streaming and not, 10 % of clients gone mid-stream, 10 %
bad requests. Nothing fails, every bad request is a 400, the KV cache comes back whole."""

from __future__ import annotations

from scripts.soak import build_parser, soak


def test_300_requests_lose_nothing_and_leak_no_kv_block(tiny_model_dir):
    args = build_parser().parse_args([
        "--model", str(tiny_model_dir), "--model-name", "tiny", "--num-requests", "300",
        "--concurrency", "32", "--max-tokens", "8", "--request-timeout", "120",
        "--server-arg=--served-model-name", "--server-arg=tiny",
        "--server-arg=--num-kv-blocks", "--server-arg=256"])
    result = soak(args)
    outcomes = result["outcomes"]
    assert "failed" not in outcomes, outcomes.get("failures")
    assert outcomes.get("bad_ok", 0) >= 15 and outcomes.get("disconnected", 0) >= 15
    assert outcomes.get("completed", 0) + outcomes.get("rejected", 0) >= 200
    assert sum(v for k, v in outcomes.items() if k != "failures") == 300
    assert result["kv_leaked_blocks"] == 0 and result["healthy_after"]
    assert result["kv"]["num_requests_running"] == 0 == result["kv"]["num_requests_waiting"]
