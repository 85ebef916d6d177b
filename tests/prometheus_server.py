"""Run a real Prometheus (Debian's ``prometheus`` binary) for a test, with tensorplay's rules loaded.

The server listens on 127.0.0.1 on a free port, keeps its TSDB in a temporary folder, scrapes the
given targets every second, evaluates ``deploy/prometheus/rules/*.yml`` every second, and keeps
exemplars (``--enable-feature=exemplar-storage``). A missing binary is an error, never a skip:
CI installs it (``apt-get install prometheus``).

Use the ``prometheus`` fixture (import it into the test module)::

    from .prometheus_server import prometheus  # noqa: F401  (a pytest fixture)

    def test_something(prometheus):
        server = prometheus(["127.0.0.1:9400", "127.0.0.1:9401"])
        server.wait_for_targets_up(2)
        server.wait_for('tensorplay_last_step_timestamp_seconds')
        assert server.query('count(up == 1)')[0]["value"][1] == "2"

or the class directly: ``with PrometheusServer(targets, tmp_dir) as server: ...``.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import pytest
import yaml

from .alert_rules import RULE_FILES
from .server_process import START_TIMEOUT_S, ServerFailed, ServerProcess, find_binary, log_tail
from .waiting import wait_until

__all__ = [
    "RULE_FILES",
    "PrometheusError",
    "PrometheusServer",
    "prometheus",
    "prometheus_binary",
]


class PrometheusError(RuntimeError):
    """The server could not start, or an API call failed."""


def prometheus_binary() -> str:
    """Return the path of the ``prometheus`` binary; raise if it is not installed."""
    try:
        return find_binary("prometheus", env="TENSORPLAY_PROMETHEUS_BIN",
                           install_hint="apt-get install -y prometheus, as .ci/run does; set "
                                        "TENSORPLAY_PROMETHEUS_BIN to use another one")
    except ServerFailed as error:
        raise PrometheusError(str(error)) from None


def render_config(
    targets: Mapping[str, Sequence[str]],
    rule_files: Sequence[os.PathLike | str],
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    scrape_timeout: str | None = None,
) -> str:
    """Return a prometheus.yml scraping ``{job name: [host:port, ...]}`` with ``rule_files`` loaded.

    The scrape timeout is the scrape interval unless ``scrape_timeout`` is given.
    """
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_timeout or scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [str(t) for t in job_targets]}]}
            for job, job_targets in targets.items()
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


class PrometheusServer:
    """A Prometheus process on 127.0.0.1 with its own config and storage under ``workdir``.

    Arguments:
        targets: ``host:port`` strings scraped under the job name ``job``, or a mapping
            ``{job name: [host:port, ...]}`` for several jobs.
        workdir: folder for the config, the TSDB and the log (created if needed).
        job: the job name used when ``targets`` is a plain list.
        rule_files: rule files to load; default: the project's (``RULE_FILES``).
        scrape_interval / evaluation_interval: Prometheus durations, 1s by default.
        scrape_timeout: how long a scrape may take (default: the scrape interval); a shorter one
            makes a target that accepts connections but never answers (a stopped process) fail
            sooner.
        extra_args: more command-line flags.
        storage: keep the TSDB in this folder (e.g. one holding blocks that promtool made)
            instead of a fresh one for each start.
    """

    def __init__(
        self,
        targets: Sequence[str] | Mapping[str, Sequence[str]],
        workdir: os.PathLike | str,
        job: str = "tensorplay",
        rule_files: Sequence[os.PathLike | str] = RULE_FILES,
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        scrape_timeout: str | None = None,
        extra_args: Sequence[str] = (),
        storage: os.PathLike | str | None = None,
    ) -> None:
        self.targets = dict(targets) if isinstance(targets, Mapping) else {job: list(targets)}
        self.workdir = Path(workdir)
        self.rule_files = list(rule_files)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.scrape_timeout = scrape_timeout
        self.extra_args = list(extra_args)
        self.storage = None if storage is None else Path(storage)
        self._server: ServerProcess | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        if self.port is None:
            raise PrometheusError("the server is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self, timeout: float = START_TIMEOUT_S) -> "PrometheusServer":
        """Start the server and wait until ``/-/ready``; raise PrometheusError if it does not come up."""
        binary = prometheus_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            render_config(self.targets, self.rule_files, self.scrape_interval, self.evaluation_interval,
                          self.scrape_timeout)
        )

        def argv(port: int) -> list[str]:
            storage = self.storage or Path(tempfile.mkdtemp(prefix="tsdb-", dir=self.workdir))
            return [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={storage}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
                *self.extra_args,
            ]

        self._server = ServerProcess("prometheus", argv, self.log_path, cwd=self.workdir)
        try:
            self._server.start(timeout)
        except ServerFailed as error:
            raise PrometheusError(str(error)) from None
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); safe to call twice."""
        if self._server is not None:
            self._server.stop(timeout)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log, for error messages."""
        return log_tail(self.log_path, chars)

    # -- HTTP API ----------------------------------------------------------------------------

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data``; raise PrometheusError on an error status."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            try:
                body = json.load(error)
            except ValueError:
                raise PrometheusError(f"GET {url}: HTTP {error.code}") from error
        if body.get("status") != "success":
            raise PrometheusError(f"GET {url}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Evaluate an instant query; return the result list (vector samples or a scalar's pair)."""
        data = self.api("query", query=expr, time=at)
        result = data["result"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Evaluate a range query; return its series (each with ``metric`` and ``values``)."""
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def query_values(self, expr: str, by: str = "rank", at: float | None = None) -> dict[str, float]:
        """Evaluate an instant query and return ``{value of label `by`: sample value}``."""
        return {s["metric"].get(by, ""): float(s["value"][1]) for s in self.query(expr, at)}

    def query_exemplars(self, expr: str, start: float, end: float) -> list[dict]:
        """Return ``/api/v1/query_exemplars`` for ``expr`` between two unix times."""
        return self.api("query_exemplars", query=expr, start=start, end=end)

    def targets_status(self) -> list[dict]:
        """Return ``/api/v1/targets``' active targets (each with ``health``, ``labels``, ``lastError``)."""
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict]:
        """Return ``/api/v1/alerts``: pending and firing alerts."""
        return self.api("alerts")["alerts"]

    def rule_groups(self) -> list[dict]:
        """Return ``/api/v1/rules``' groups as loaded and evaluated by the server."""
        return self.api("rules")["groups"]

    # -- waiting -----------------------------------------------------------------------------

    def wait_until(self, predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        """Poll ``predicate`` until it returns something truthy; return it, or fail after ``timeout``."""
        return wait_until(predicate, timeout, what, interval=0.25)

    def wait_for(self, expr: str, timeout: float = 30.0, count: int = 1) -> list[dict]:
        """Wait until ``expr`` returns at least ``count`` samples; return them."""
        return self.wait_until(
            lambda: (lambda r: r if len(r) >= count else None)(self.query(expr)),
            timeout,
            f"{count} result(s) of {expr!r}",
        )

    def wait_for_targets_up(self, count: int, timeout: float = 30.0) -> list[dict]:
        """Wait until ``count`` targets have been scraped successfully; return the target list."""

        def up() -> list[dict] | None:
            targets = self.targets_status()
            return targets if sum(t["health"] == "up" for t in targets) >= count else None

        def targets() -> str:
            return f"targets: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in self.targets_status()]}"

        return wait_until(up, timeout, f"{count} target(s) up", interval=0.25, details=targets)


@pytest.fixture
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., PrometheusServer]]:
    """Start Prometheus servers for a test: ``prometheus(targets, **PrometheusServer options)``.

    Each call starts one server (ready when it returns); all are stopped when the test ends.
    """
    servers: list[PrometheusServer] = []

    def start(targets: Sequence[str] | Mapping[str, Sequence[str]], **options: Any) -> PrometheusServer:
        server = PrometheusServer(targets, tmp_path_factory.mktemp("prometheus"), **options)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
