"""The server's speculative decoding counters over one benchmark run, read from /metrics.

The counters are DeepInfer's (`deepinfer_spec_decode_*_total`); a server without them (or
without /metrics) simply gets no speculation figures. The text is parsed here with
prometheus_client's parser: the bench stays a plain HTTP client of the server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "deepinfer_spec_decode_draft_tokens_total"
ACCEPTED = "deepinfer_spec_decode_accepted_tokens_total"
VERIFY_STEPS = "deepinfer_spec_decode_verify_steps_total"
DRAFTS_BY_POSITION = "deepinfer_spec_decode_draft_tokens_per_position_total"
ACCEPTED_BY_POSITION = "deepinfer_spec_decode_accepted_tokens_per_position_total"
SCRAPE_TIMEOUT_S = 10.0

# Report keys, None when the run has no speculation figures.
REPORT_KEYS = ("spec_decode_acceptance_rate", "spec_decode_mean_accepted_length",
               "spec_decode_acceptance_by_position")


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    accepted: float
    verify_steps: float
    drafts_by_position: dict[int, float] = field(default_factory=dict)
    accepted_by_position: dict[int, float] = field(default_factory=dict)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The spec counters in a Prometheus text page; None if any total is missing or the page is
    not Prometheus text."""
    totals: dict[str, float] = {}
    by_position: dict[str, dict[int, float]] = {DRAFTS_BY_POSITION: {}, ACCEPTED_BY_POSITION: {}}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in by_position and "position" in sample.labels:
                    by_position[sample.name][int(sample.labels["position"])] = sample.value
                elif sample.name in (DRAFTS, ACCEPTED, VERIFY_STEPS):
                    totals[sample.name] = sample.value
    except ValueError:  # an HTML error page, say
        return None
    if len(totals) < 3:
        return None
    return SpecCounters(totals[DRAFTS], totals[ACCEPTED], totals[VERIFY_STEPS],
                        by_position[DRAFTS_BY_POSITION], by_position[ACCEPTED_BY_POSITION])


def spec_report(before: SpecCounters | None, after: SpecCounters | None) -> dict[str, Any]:
    """Acceptance over the run (deltas): rate = accepted / drafts; mean accepted length =
    (accepted + verify steps) / verify steps, the tokens one verifying step yields (its
    accepted drafts plus the target's own token), as vLLM reports it. None where the server
    has no counters or verified no draft during the run."""
    report: dict[str, Any] = dict.fromkeys(REPORT_KEYS)
    if before is None or after is None:
        return report
    drafts = after.drafts - before.drafts
    accepted = after.accepted - before.accepted
    steps = after.verify_steps - before.verify_steps
    if drafts <= 0 or steps <= 0:
        return report
    report["spec_decode_acceptance_rate"] = accepted / drafts
    report["spec_decode_mean_accepted_length"] = (accepted + steps) / steps
    report["spec_decode_acceptance_by_position"] = _by_position(before, after)
    return report


def _by_position(before: SpecCounters, after: SpecCounters) -> list[float | None]:
    rates: list[float | None] = []
    for pos in sorted(after.drafts_by_position):
        drafts = after.drafts_by_position[pos] - before.drafts_by_position.get(pos, 0.0)
        accepted = after.accepted_by_position.get(pos, 0.0) - before.accepted_by_position.get(
            pos, 0.0)
        rates.append(accepted / drafts if drafts > 0 else None)
    return rates


async def scrape_spec_counters(session, base_url: str) -> SpecCounters | None:
    """GET <base_url>/metrics; None if it fails or has no spec counters (never raises for
    that: the benchmark does not depend on it)."""
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with session.get(f"{base_url}/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        return None
    return parse_spec_counters(text)
