"""deploy/alertmanager/alertmanager.yml: valid for Debian's amtool, and a real Alertmanager run on it
turns hundreds of per-rank alerts into one group -- one notification -- per alert and job.

amtool and Alertmanager are required: a missing binary fails these tests (CI installs Debian's
`prometheus-alertmanager`).
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from .ranks import free_port

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "alertmanager" / "alertmanager.yml"
INSTALL_HINT = "apt-get install -y prometheus-alertmanager, as .ci/run does"


def _binary(*names: str) -> str:
    path = next((found for name in names if (found := shutil.which(name))), None)
    assert path, f"{' / '.join(names)} is not installed ({INSTALL_HINT})"
    return path


def test_amtool_check_config():
    result = subprocess.run([_binary("amtool"), "check-config", str(CONFIG)], capture_output=True, text=True,
                            timeout=60)
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
def alertmanager(tmp_path: Path):
    """Debian's Alertmanager on 127.0.0.1 with the shipped config; yields its base URL."""
    binary = _binary("prometheus-alertmanager", "alertmanager")
    log_path = tmp_path / "alertmanager.log"
    with open(log_path, "wb") as log:
        for _attempt in range(3):  # a free port can be taken between probing and binding
            base = f"http://127.0.0.1:{free_port()}"
            process = subprocess.Popen(
                [binary, f"--config.file={CONFIG}", f"--storage.path={tmp_path / 'data'}",
                 f"--web.listen-address={base.removeprefix('http://')}", "--cluster.listen-address=",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            try:
                if _ready(base, process):
                    yield base
                    return
            finally:
                process.terminate()
                process.wait(10)
    pytest.fail(f"Alertmanager did not start:\n{log_path.read_text()}")


def _ready(base: str, process: subprocess.Popen, timeout: float = 20.0) -> bool:
    """Wait until Alertmanager answers /-/ready; False if it exited (e.g. its port was taken)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/-/ready", timeout=1):
                return True
        except (urllib.error.URLError, ConnectionError, OSError, http.client.HTTPException):  # a self-connection reads back its request
            time.sleep(0.1)
    return False


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

    groups = _api(alertmanager, "/api/v2/alerts/groups")
    found = {(g["labels"]["alertname"], g["labels"]["job"]): g for g in groups}
    assert all(set(g["labels"]) == {"alertname", "job"} for g in groups), [g["labels"] for g in groups]
    assert {key: len(g["alerts"]) for key, g in found.items()} == {
        ("TensorplayRankMetricsMissing", "bert"): 300,
        ("TensorplayRankMetricsMissing", "gpt"): 20,
        ("TensorplayRankStalled", "bert"): 5,
    }
    assert {g["receiver"]["name"] for g in groups} == {"tensorplay"}
