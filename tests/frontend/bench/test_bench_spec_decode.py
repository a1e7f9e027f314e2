"""`deepinfer bench serve` reports the server's speculative acceptance over the run (from /metrics
deltas), and nothing about it when the server has no speculation figures."""

from __future__ import annotations

import json
import socket
import threading
import time

import msgspec
import pytest
import uvicorn

from deepinfer.engine.protocol import SchedulerStats
from deepinfer.frontend import cli
from deepinfer.frontend.bench.metrics import format_report
from deepinfer.frontend.bench.spec_decode import SpecCounters, parse_spec_counters, spec_report
from deepinfer.frontend.server.app import build_app
from tests.frontend.server.fake_engine import FakeEngineClient

PAGE = """\
# TYPE deepinfer_engine_steps_total counter
deepinfer_engine_steps_total 7.0
# TYPE deepinfer_spec_decode_draft_tokens_total counter
deepinfer_spec_decode_draft_tokens_total 30.0
# TYPE deepinfer_spec_decode_accepted_tokens_total counter
deepinfer_spec_decode_accepted_tokens_total 18.0
# TYPE deepinfer_spec_decode_verify_steps_total counter
deepinfer_spec_decode_verify_steps_total 10.0
# TYPE deepinfer_spec_decode_draft_tokens_per_position_total counter
deepinfer_spec_decode_draft_tokens_per_position_total{position="0"} 10.0
deepinfer_spec_decode_draft_tokens_per_position_total{position="1"} 10.0
# TYPE deepinfer_spec_decode_accepted_tokens_per_position_total counter
deepinfer_spec_decode_accepted_tokens_per_position_total{position="0"} 9.0
deepinfer_spec_decode_accepted_tokens_per_position_total{position="1"} 6.0
"""
NO_FIGURES = dict.fromkeys(["spec_decode_acceptance_rate", "spec_decode_mean_accepted_length",
                            "spec_decode_acceptance_by_position"])


def test_parse_spec_counters():
    assert parse_spec_counters(PAGE) == SpecCounters(30, 18, 10, {0: 10, 1: 10}, {0: 9, 1: 6})


@pytest.mark.parametrize("text", [
    "# TYPE deepinfer_engine_steps_total counter\ndeepinfer_engine_steps_total 7.0\n",
    PAGE.replace("deepinfer_spec_decode_verify_steps_total 10.0\n", ""),
    "<html><body>Not Found</body></html>",
    "",
])
def test_pages_without_spec_counters(text):
    assert parse_spec_counters(text) is None


def test_spec_report_uses_the_run_deltas():
    before = SpecCounters(30, 18, 10, {0: 10, 1: 10}, {0: 9, 1: 6})
    # This run: 5 verifying steps, 10 drafts (5 per position), 6 accepted (4 then 2).
    after = SpecCounters(40, 24, 15, {0: 15, 1: 15, 2: 0}, {0: 13, 1: 8})
    report = spec_report(before, after)
    assert report["spec_decode_acceptance_rate"] == pytest.approx(0.6)
    assert report["spec_decode_mean_accepted_length"] == pytest.approx((6 + 5) / 5)
    assert report["spec_decode_acceptance_by_position"] == [
        pytest.approx(0.8), pytest.approx(0.4), None]


@pytest.mark.parametrize("before,after", [
    (None, None),
    (SpecCounters(30, 18, 10), None),
    (SpecCounters(30, 18, 10), SpecCounters(30, 18, 10)),  # speculation off or not used
])
def test_spec_report_is_null_without_figures(before, after):
    assert spec_report(before, after) == NO_FIGURES


def test_format_report_shows_spec_only_when_known():
    base = {"completed": 1, "failed": 0, "duration_s": 1.0, "total_input_tokens": 1,
            "total_output_tokens": 1, "request_throughput": 1.0, "output_throughput": 1.0,
            "total_token_throughput": 2.0}
    for key in ("ttft", "tpot", "itl", "e2el"):
        base |= {f"{s}_{key}_ms": 1.0 for s in ("mean", "median", "p90", "p99")}
    assert "Speculative" not in format_report(base | NO_FIGURES)
    text = format_report(base | {"spec_decode_acceptance_rate": 0.6,
                                 "spec_decode_mean_accepted_length": 2.2,
                                 "spec_decode_acceptance_by_position": [0.8, 0.4, None]})
    assert "Speculative Decoding" in text
    assert any(line.startswith("Acceptance rate:") and line.endswith("0.60")
               for line in text.splitlines())
    assert any(line.startswith("Mean accepted length") and line.endswith("2.20")
               for line in text.splitlines())
    assert "0.80 0.40 -" in text


class SpeculatingEngine(FakeEngineClient):
    """Each finished request adds one verifying step of 3 drafts: the first request (the
    warm-up) has none accepted, every later one the first 2."""

    def __init__(self, speculating: bool) -> None:
        super().__init__()
        self.speculating = speculating
        # Counters from before the run must not count.
        self.stats = SchedulerStats(spec_verify_steps=50, spec_draft_tokens=150,
                                    spec_accepted_tokens=20, spec_drafts_by_position=[50, 50, 50],
                                    spec_accepted_by_position=[10, 10, 0])

    async def generate(self, req):
        async for out in super().generate(req):
            if out.finish_reason is not None and self.speculating:
                self.count_one_step()  # before the client can see the request end
            yield out

    def count_one_step(self) -> None:
        s = self.stats
        accepted = (0, 0, 0) if s.spec_verify_steps == 50 else (1, 1, 0)
        self.stats = msgspec.structs.replace(
            s, spec_verify_steps=s.spec_verify_steps + 1,
            spec_draft_tokens=s.spec_draft_tokens + 3,
            spec_accepted_tokens=s.spec_accepted_tokens + sum(accepted),
            spec_drafts_by_position=[n + 1 for n in s.spec_drafts_by_position],
            spec_accepted_by_position=[n + d for n, d in
                                       zip(s.spec_accepted_by_position, accepted)])


def serve_in_thread(engine, state):
    """The fake-engine app on a real socket (the bench is an aiohttp client)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(state, lambda: engine), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("speculating", [True, False])
def test_bench_serve_prints_the_run_acceptance(state, tmp_path, capsys, speculating):
    server, thread, base_url = serve_in_thread(SpeculatingEngine(speculating), state)
    out = tmp_path / "bench.json"
    try:
        code = cli.main(["bench", "serve", "--base-url", base_url, "--num-prompts", "4",
                         "--num-warmups", "1", "--max-concurrency", "2",
                         "--random-input-len", "4", "--random-output-len", "3",
                         "--result-file", str(out), "--disable-tqdm"])
    finally:
        server.should_exit = True
        thread.join(10)
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0 and report["completed"] == 4
    if not speculating:
        assert "Speculative" not in printed and "Acceptance" not in printed
        assert {k: report[k] for k in NO_FIGURES} == NO_FIGURES
        return
    # 4 measured requests, the warm-up excluded: 8 of 12 drafts accepted, 3 tokens per step.
    assert report["spec_decode_acceptance_rate"] == pytest.approx(8 / 12)
    assert report["spec_decode_mean_accepted_length"] == pytest.approx(3.0)
    assert report["spec_decode_acceptance_by_position"] == [1.0, 1.0, 0.0]
    lines = printed.splitlines()
    assert any(line.startswith("Acceptance rate:") and line.endswith("0.67") for line in lines)
    assert any(line.startswith("Mean accepted length") and line.endswith("3.00")
               for line in lines)
