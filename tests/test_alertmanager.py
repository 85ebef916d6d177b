"""deploy/alertmanager/alertmanager.yml: valid for Debian's amtool, and a real Alertmanager run on it
turns hundreds of per-rank alerts into one group -- one notification -- per alert and job.

amtool and Alertmanager are required: a missing binary fails these tests (CI installs Debian's
`prometheus-alertmanager`).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from .server_process import ServerProcess, find_binary
from .waiting import wait_until

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "alertmanager" / "alertmanager.yml"
INSTALL_HINT = "apt-get install -y prometheus-alertmanager, as .ci/run does"


def test_amtool_check_config():
    amtool = find_binary("amtool", install_hint=INSTALL_HINT)
    result = subprocess.run([amtool, "check-config", str(CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_route_groups_by_alertname_and_job():
    def routes(route: dict):
        yield route
        for child in route.get("routes", []):
            yield from routes(child)

    for route in routes(yaml.safe_load(CONFIG.read_text())["route"]):
        assert route.get("group_by", ["alertname", "job"]) == ["alertname", "job"], route


def _api(base: str, path: str, body: object | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
    return json.loads(text) if text else None


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """Debian's Alertmanager on 127.0.0.1 with the shipped config; yields its base URL."""
    binary = find_binary("prometheus-alertmanager", "alertmanager", install_hint=INSTALL_HINT)

    def argv(port: int) -> list[str]:
        return [binary, f"--config.file={CONFIG}", f"--storage.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"]

    with ServerProcess("alertmanager", argv, tmp_path / "alertmanager.log") as server:
        yield server.url


def test_per_rank_alerts_make_one_group_per_alert_and_job(alertmanager: str):
    """300 ranks of one job go missing (a rack lost its network), 20 of another, and 5 ranks of the
    first stall: three groups, each with all its ranks, one notification each."""
    def alert(name: str, job: str, rank: int, **labels: str) -> dict:
        return {"labels": {"alertname": name, "job": job, "rank": str(rank), "severity": "warning", **labels},
                "annotations": {"summary": name}}

    alerts = [alert("TensorplayRankMetricsMissing", "bert", r) for r in range(300)]
    alerts += [alert("TensorplayRankMetricsMissing", "gpt", r) for r in range(20)]
    alerts += [alert("TensorplayRankStalled", "bert", r, severity="critical") for r in range(5)]
    _api(alertmanager, "/api/v2/alerts", alerts)

    expected = {
        ("TensorplayRankMetricsMissing", "bert"): 300,
        ("TensorplayRankMetricsMissing", "gpt"): 20,
        ("TensorplayRankStalled", "bert"): 5,
    }
    seen: list = []

    def grouped() -> list | None:
        """The groups once Alertmanager has placed every posted alert (its dispatcher does so
        after the POST has returned, so a read right after it can see a group still filling)."""
        groups = _api(alertmanager, "/api/v2/alerts/groups")
        seen[:] = [groups]
        counts = {(g["labels"].get("alertname"), g["labels"].get("job")): len(g["alerts"]) for g in groups}
        return groups if sum(counts.values()) >= sum(expected.values()) else None

    groups = wait_until(grouped, 30, "Alertmanager to group every posted alert", details=lambda: repr(seen)[:2000])
    found = {(g["labels"]["alertname"], g["labels"]["job"]): g for g in groups}
    assert all(set(g["labels"]) == {"alertname", "job"} for g in groups), [g["labels"] for g in groups]
    assert {key: len(g["alerts"]) for key, g in found.items()} == expected
    assert {g["receiver"]["name"] for g in groups} == {"tensorplay"}
