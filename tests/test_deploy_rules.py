"""deploy/: Prometheus config and rules pass promtool (check + unit tests), the Kubernetes copy of the
rules is the same, and the stack's files agree with each other.

promtool is required: a missing binary fails these tests (CI installs Debian's `prometheus`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .alert_rules import RULE_FILES, alert_expr, alert_rules, alerts, rules
from .dashboard_queries import known_series, selectors

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULE_TESTS = sorted((ROOT / "tests" / "rules").glob("*.yml"))
CONTRACT_ALERTS = {
    # alert: the labels the contract gives it (sections 4 and 7), besides severity; `job` is added to all
    "TensorplayStragglerRank": {"rank"},
    "TensorplayUnevenInputs": {"rank"},
    "TensorplayRankStalled": {"rank"},
    "TensorplayJobHung": {"job"},
    "TensorplayRankMetricsMissing": {"rank"},
    "TensorplayGradientOverflow": {"rank", "hook"},
    # section 7
    "TensorplayReplicasDiverged": {"job"},
    "TensorplayGradientsNotReduced": {"rank"},
}
ALERT_LABELS = CONTRACT_ALERTS  # an alert beyond the contract would be documented in docs/telemetry.md
RUNBOOK_BASE = "https://github.com/tensorplay/tensorplay/blob/main/deploy/RUNBOOK.md#"


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (apt-get install -y prometheus, as .ci/run does)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _load(path: Path):
    return yaml.safe_load(path.read_text())


# -- promtool -------------------------------------------------------------------------------------


def test_promtool_check_config():
    result = promtool("check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules():
    assert RULE_FILES
    result = promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules():
    assert RULE_TESTS
    result = promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS), result.stdout


# -- the alerts -----------------------------------------------------------------------------------


def test_contract_alerts_are_defined_as_the_conventions_ask():
    assert set(alerts()) == set(ALERT_LABELS)
    runbook = (DEPLOY / "RUNBOOK.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-") for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert "{{" not in annotations["summary"], f"{name}: summary is fixed text"
        for label in ALERT_LABELS[name] | {"job"}:
            assert f"$labels.{label}" in annotations["description"], f"{name}: description does not name its {label}"
        assert "$value" in annotations["description"], name
        url = annotations["runbook_url"]
        assert url == RUNBOOK_BASE + name.lower(), name
        assert url.split("#")[1] in anchors, f"{name}: no section in deploy/RUNBOOK.md"


def test_an_alert_of_several_rules_has_one_per_severity():
    """An alert written as several rules (one per severity) differs between them only in its
    expression, severity and how long it keeps firing (the straggler's critical, for the hand-over
    to its warning): the same `for:`, annotations and runbook."""
    for name in alerts():
        written = alert_rules(name)
        severities = [rule["labels"]["severity"] for rule in written]
        assert len(set(severities)) == len(written), (name, severities)
        shared = [{k: v for k, v in rule.items() if k not in ("expr", "labels", "keep_firing_for")} for rule in written]
        assert all(one == shared[0] for one in shared), name


def test_every_alert_is_unit_tested_before_and_after_it_fires():
    """... at each of its severities."""
    seen: dict[tuple[str, str], set[str]] = {
        (rule["alert"], rule["labels"]["severity"]): set() for rule in alert_rules()}
    before: set[str] = set()
    for path in RULE_TESTS:
        for case in _load(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                fired = check.get("exp_alerts") or []
                if not fired:
                    before.add(name)
                for alert in fired:
                    labels = alert["exp_labels"]
                    assert set(labels) == ALERT_LABELS[name] | {"job", "severity"}, (path.name, name, labels)
                    assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}, (path.name, name)
                    seen[(name, labels["severity"])].add("after")
    for (name, severity), cases in seen.items():
        assert name in before and cases == {"after"}, (name, severity, cases)


def test_rules_read_only_known_series():
    known = known_series()
    for rule in rules():
        for selector in selectors(rule["expr"]):
            assert selector.metric in known, f"{rule.get('record') or rule.get('alert')}: unknown series {selector.metric}"


def test_thresholds_and_windows_are_documented():
    readme = (DEPLOY / "README.md").read_text()
    for rule in alert_rules():
        name = rule["alert"]
        assert name in readme, f"{name} is not described in deploy/README.md"
        assert f"`for: {rule['for']}`" in readme, f"{name}'s for: {rule['for']} is not in deploy/README.md"


def test_hang_alerts_share_one_documented_threshold():
    """RankStalled, JobHung and RankMetricsMissing compare waits (and RankStalled the latest hook
    call) with one threshold, the one deploy/README.md gives; the end-to-end tests substitute it by
    value."""
    numbers = {
        name: {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", alerts()[name]["expr"])} - {0.0}
        for name in ("TensorplayRankStalled", "TensorplayJobHung", "TensorplayRankMetricsMissing")
    }
    (threshold,) = numbers["TensorplayRankStalled"]
    assert numbers["TensorplayJobHung"] == numbers["TensorplayRankMetricsMissing"] == {threshold}, numbers
    assert f"{threshold:g} s" in (DEPLOY / "README.md").read_text()


def test_alert_expr_substitutes_whole_numbers_only():
    stalled = alert_expr("TensorplayRankStalled", {120: 3})
    assert "120" not in stalled and "< 3" in stalled and "> 3" in stalled
    assert stalled.replace("< 3", "< 120").replace("> 3", "> 120") == alert_expr("TensorplayRankStalled")
    # Digits inside names and durations are not numbers of the expression.
    with pytest.raises(ValueError, match="no number"):
        alert_expr("TensorplayStragglerRank", {5: 1})
    with pytest.raises(ValueError, match="no number"):
        alert_expr("TensorplayRankMetricsMissing", {30: 1})


# -- Kubernetes -----------------------------------------------------------------------------------


def test_prometheusrule_carries_the_rule_files():
    resource = _load(DEPLOY / "kubernetes" / "prometheusrule.yaml")
    assert resource["apiVersion"] == "monitoring.coreos.com/v1" and resource["kind"] == "PrometheusRule"
    groups = [group for path in RULE_FILES for group in _load(path)["groups"]]
    assert sorted(resource["spec"]["groups"], key=lambda g: g["name"]) == sorted(groups, key=lambda g: g["name"])
    # ... and it is exactly what the generator writes.
    sys.path.insert(0, str(DEPLOY / "kubernetes"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    assert (DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text() == generate.render(), (
        "run: python deploy/kubernetes/generate.py"
    )


def test_prometheusrule_spec_passes_promtool(tmp_path: Path):
    spec = _load(DEPLOY / "kubernetes" / "prometheusrule.yaml")["spec"]
    rule_file = tmp_path / "spec.yml"
    rule_file.write_text(yaml.safe_dump(spec))
    result = promtool("check", "rules", str(rule_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_podmonitor_keeps_the_per_rank_ports():
    monitor = _load(DEPLOY / "kubernetes" / "podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint and endpoint["path"] == "/metrics"
    keep = next(r for r in endpoint["relabelings"] if r.get("action") == "keep")
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    assert all(re.fullmatch(keep["regex"], f"tp-rank-{r}") for r in range(8))
    assert not re.fullmatch(keep["regex"], "http")
    assert monitor["spec"]["jobLabel"] == "tensorplay/job"  # one `job` per training run


# -- the compose stack ----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    lines = (DEPLOY / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_compose_pins_images_in_one_place():
    compose = _load(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana", "tempo", "otel-collector"}
    env = _env()
    used = set()
    for name, service in services.items():
        match = re.fullmatch(r"\$\{(\w+):\?[^}]*\}", service["image"])
        assert match, f"{name}: image must come from deploy/.env, got {service['image']}"
        used.add(match.group(1))
    assert used == set(env)
    for variable, image in env.items():
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest" and re.search(r"\d", tag), f"{variable}={image}"


def test_compose_mounts_and_flags():
    compose = _load(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
    provider = _load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "tensorplay.yaml")["providers"][0]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert mounts[provider["options"]["path"]] == "../dashboards"


def _flag(command: list[str], name: str) -> str:
    return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}="))


def test_prometheus_sends_alerts_to_the_stacks_alertmanager():
    services = _load(DEPLOY / "compose.yaml")["services"]
    alertmanager = services["alertmanager"]
    (config,) = _load(DEPLOY / "prometheus" / "prometheus.yml")["alerting"]["alertmanagers"]
    (target,) = [t for group in config["static_configs"] for t in group["targets"]]
    host, port = target.rsplit(":", 1)
    assert host == "alertmanager" and f"{port}" in {p.rsplit(":", 1)[1] for p in alertmanager["ports"]}
    # Alertmanager reads the shipped file, and keeps its single instance out of HA gossip.
    mounts = {v.split(":")[1]: v.split(":")[0] for v in alertmanager["volumes"]}
    config_file = Path(_flag(alertmanager["command"], "config.file"))
    assert (DEPLOY / mounts[str(config_file.parent)] / config_file.name) == DEPLOY / "alertmanager" / "alertmanager.yml"
    assert _flag(alertmanager["command"], "cluster.listen-address") == ""


def test_grafana_datasources_link_exemplars_to_tempo():
    datasources = _load(DEPLOY / "grafana" / "provisioning" / "datasources" / "tensorplay.yaml")["datasources"]
    by_type = {d["type"]: d for d in datasources}
    prometheus, tempo = by_type["prometheus"], by_type["tempo"]
    assert prometheus["uid"] == "tensorplay-prometheus" and tempo["uid"] == "tensorplay-tempo"
    assert prometheus["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "datasourceUid": tempo["uid"]}
    ]
    scrape = _load(DEPLOY / "prometheus" / "prometheus.yml")["global"]["scrape_interval"]
    assert prometheus["jsonData"]["timeInterval"] == scrape


LARGE_JOBS = "### Scrape interval and Grafana's `timeInterval` at scale"


def _seconds(duration: str) -> int:
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600}[unit] for n, unit in re.findall(r"(\d+)([smh])", duration))


def test_large_job_intervals_agree_with_the_podmonitor_and_the_rule_windows():
    """deploy/README.md gives a large job one interval for scraping, rule evaluation and Grafana's
    timeInterval; the PodMonitor scrapes at it, it is no shorter than the compose stack's, and the
    rules' shortest rate window holds at least 4 of its scrapes (what $__rate_interval assumes)."""
    readme = (DEPLOY / "README.md").read_text()
    section = readme[readme.index(LARGE_JOBS):]
    section = section[:section.find("\n## ")]
    said = {key: set(re.findall(rf"`{key}: (\w+)`", section))
            for key in ("scrape_interval", "evaluation_interval", "timeInterval", "interval")}
    assert all(len(values) == 1 for values in said.values()), said
    (large,) = set.union(*said.values())
    (endpoint,) = _load(DEPLOY / "kubernetes" / "podmonitor.yaml")["spec"]["podMetricsEndpoints"]
    assert endpoint["interval"] == large
    compose = _load(DEPLOY / "prometheus" / "prometheus.yml")["global"]
    assert _seconds(large) >= _seconds(compose["scrape_interval"]) == _seconds(compose["evaluation_interval"])
    windows = [_seconds(s.range) for rule in rules() if "record" in rule for s in selectors(rule["expr"]) if s.range]
    assert windows and min(windows) >= 4 * _seconds(large), (windows, large)


def test_collector_limits_memory_first_and_exports_to_tempo():
    config = _load(DEPLOY / "otel-collector" / "config.yaml")
    protocols = config["receivers"]["otlp"]["protocols"]
    assert set(protocols) == {"grpc", "http"}
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert pipeline["processors"][0] == "memory_limiter" and "batch" in pipeline["processors"]
    (exporter,) = pipeline["exporters"]
    assert exporter.split("/")[0] == "otlp" and config["exporters"][exporter]["endpoint"] == "tempo:4317"
    tempo = _load(DEPLOY / "tempo" / "tempo.yaml")
    assert tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")


def test_file_sd_example_is_a_target_list():
    groups = _load(DEPLOY / "prometheus" / "file_sd_example.yml")
    assert groups and all(set(g) <= {"targets", "labels"} and g["targets"] for g in groups)
    assert all("job" in g["labels"] for g in groups)


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.y*ml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path):
    assert yaml.safe_load(path.read_text()) is not None
