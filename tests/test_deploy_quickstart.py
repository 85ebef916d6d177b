"""The deploy quick start works as written: the demo command of deploy/README.md ("Run the stack and
scrape a job") serves exactly the targets the compose Prometheus scrapes, on an address the
container can reach, for long enough to be scraped.

The command is read from the README and parsed by the demo's own argument parser, so a flag the
demo does not have, or a value it refuses, fails here too.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tensorplay.cli import build_parser
from tensorplay.demo.options import job_problem
from tensorplay.telemetry.metrics import DEFAULT_METRICS_PORT

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SECTION = "## Run the stack and scrape a job"
SCRAPE_JOB = "tensorplay-demo"


def _quickstart_commands() -> list[list[str]]:
    """Every `tensorplay demo` command of the section's shell blocks, continuation lines joined."""
    readme = (DEPLOY / "README.md").read_text()
    section = readme[readme.index(SECTION):]
    section = section[:section.find("\n## ", len(SECTION))]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line)
            if argv[:2] == ["tensorplay", "demo"]:
                commands.append(argv)
    return commands


COMMANDS = _quickstart_commands()


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration).groups()
    return float(value) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[unit]


def test_the_section_has_a_demo_command():
    assert len(COMMANDS) == 1, COMMANDS


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_demo_command_serves_the_compose_scrape_targets(argv: list[str]):
    args = build_parser().parse_args(argv[1:])
    assert job_problem(args, args.world_size, args.world_size) is None

    config = _load("prometheus/prometheus.yml")
    (scrape,) = [job for job in config["scrape_configs"] if job["job_name"] == SCRAPE_JOB]
    targets = [target for group in scrape["static_configs"] for target in group["targets"]]
    hosts = {target.rsplit(":", 1)[0] for target in targets}
    ports = sorted(int(target.rsplit(":", 1)[1]) for target in targets)

    base = args.metrics_port if args.metrics_port is not None else DEFAULT_METRICS_PORT
    assert ports == [base + rank for rank in range(args.world_size)], (ports, base, args.world_size)

    # The targets name the host as compose maps it, and the ranks bind an address that mapping
    # reaches: host-gateway is the host's bridge address, never its loopback.
    (host,) = hosts
    prometheus = _load("compose.yaml")["services"]["prometheus"]
    assert f"{host}:host-gateway" in prometheus["extra_hosts"], prometheus["extra_hosts"]
    assert args.metrics_addr != "localhost"
    assert not ipaddress.ip_address(args.metrics_addr).is_loopback, args.metrics_addr

    # The ranks outlive training by at least two scrapes: the final values are scraped.
    assert args.linger_s >= 2 * _seconds(config["global"]["scrape_interval"]), args.linger_s


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_demo_command_exports_spans_to_the_compose_collector(argv: list[str]):
    args = build_parser().parse_args(argv[1:])
    endpoint = urlsplit(args.otlp_endpoint)
    collector = _load("compose.yaml")["services"]["otel-collector"]
    published = {mapping.rsplit(":", 2)[-2] for mapping in collector["ports"]}
    assert endpoint.hostname == "localhost" and str(endpoint.port) in published, (args.otlp_endpoint, published)
