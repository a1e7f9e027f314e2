"""examples/grafana/deepinfer.json queries only what DeepInfer exports: every metric (and every
label it groups by) of every panel is on a running server's or router's /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from scripts.server_process import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "deepinfer.json"


def exported(url: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from one /metrics scrape."""
    out: dict[str, set[str]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        name = name.split(" ")[0]
        labels = set(re.findall(r'(\w+)="', rest.partition("}")[0])) if rest else set()
        out.setdefault(name, set()).update(labels)
    return out


@pytest.fixture(scope="module")
def metrics(tiny_model_dir):
    server = ServerProcess(tiny_model_dir, "--num-kv-blocks", "64", "--served-model-name", "tiny")
    router = ServerProcess(None, "--worker", server.base_url, command="router", timeout=60)
    try:  # one request through both: labelled series appear with their first sample
        r = httpx.post(f"{router.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200
        yield exported(server.base_url) | exported(router.base_url)
    finally:
        router.stop()
        server.stop()


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_panel_queries_exported_metrics_and_labels(metrics):
    assert len(queries()) >= 20
    for expr in queries():
        names = re.findall(r"deepinfer_\w+", expr)
        assert names, expr
        for name in names:
            assert name in metrics, f"{name} (in {expr!r}) is not exported"
        # `sum by (label) (... metric ...)`: the metric carries that label.
        for label, inner in re.findall(r"by \((\w+)\) \((.*?deepinfer_\w+)", expr):
            if label == "le":
                continue
            name = re.findall(r"deepinfer_\w+", inner)[-1]
            assert label in metrics[name], f"{name} has no label {label!r} ({expr!r})"


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "DeepInfer"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dashboard["panels"]
               for t in p["targets"])
