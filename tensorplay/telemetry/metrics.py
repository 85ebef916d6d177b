"""tensorplay's Prometheus metrics: the families, the process-wide switch, and the per-rank endpoint.

Metrics are off until :func:`enable_metrics` is called, or until a traced hook or ``Join`` runs
in a process whose environment sets ``TENSORPLAY_METRICS_PORT`` (the torchrun way). Each rank
serves ``/metrics`` on ``base port + LOCAL_RANK``.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any, Iterator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric as MetricFamily

from .inflight import CollectivesInFlight
from .names import Metric
from .server import MetricsServer

__all__ = [
    "TensorplayMetrics",
    "ReplicaFingerprints",
    "enable_metrics",
    "disable_metrics",
    "active_metrics",
    "served_address",
    "wait_for_final_scrape",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_METRICS_ADDR",
]

_logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400
DEFAULT_METRICS_ADDR = "0.0.0.0"
PORT_ENV = "TENSORPLAY_METRICS_PORT"
ADDR_ENV = "TENSORPLAY_METRICS_ADDR"

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ERROR_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
JOIN_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)


class _WithoutCreated:
    """Serves a registry's families without their ``_created`` samples.

    prometheus_client adds one ``<name>_created`` series per counter and histogram child: 18 of a
    rank's 102 series with one hook, read by no rule, panel or alert (Prometheus 2.x stores them as
    plain gauges). Dropping them here, rather than with prometheus_client's process-wide
    ``disable_created_metrics()``, leaves an application's own metrics in the same process as
    they are.
    """

    def __init__(self, families: CollectorRegistry) -> None:
        self._families = families

    def collect(self) -> Iterator[MetricFamily]:
        for family in self._families.collect():
            if family.type in ("counter", "histogram", "summary"):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family

    def describe(self) -> list[MetricFamily]:
        return list(self.collect())


class TensorplayMetrics:
    """All tensorplay metric families, served from one registry without ``_created`` series."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        families = CollectorRegistry(auto_describe=True)
        hook_labels = ("rank", "hook")
        rank_label = ("rank",)
        r = families
        self.allreduce_latency = Histogram(
            Metric.ALLREDUCE_LATENCY,
            "Launch of a hook's first collective to completion of its last, per bucket.",
            hook_labels, buckets=LATENCY_BUCKETS, registry=r,
        )
        self.bucket_bytes = Counter(Metric.BUCKET_BYTES, "Bytes of gradient buckets handed to hooks.", hook_labels, registry=r)
        self.wire_bytes = Counter(Metric.WIRE_BYTES, "Bytes hooks sent into collectives.", hook_labels, registry=r)
        self.compression_error = Histogram(
            Metric.COMPRESSION_ERROR,
            "Relative L2 error of this rank's contribution made by compression, per bucket.",
            hook_labels, buckets=ERROR_BUCKETS, registry=r,
        )
        self.nonfinite = Counter(
            Metric.NONFINITE, "Elements made non-finite by compression (e.g. fp16 overflow).", hook_labels, registry=r
        )
        self.bucket_nonfinite = Counter(
            Metric.BUCKET_NONFINITE,
            "Elements already non-finite in buckets handed to compressing hooks (NaN/inf gradients).",
            hook_labels, registry=r,
        )
        self.step_compute = Histogram(
            Metric.STEP_COMPUTE,
            "This rank's own work per iteration: previous iteration's last collective done to first hook call.",
            rank_label, buckets=LATENCY_BUCKETS, registry=r,
        )
        self.step_wait = Counter(
            Metric.STEP_WAIT,
            "Seconds this rank waited at the end of its steps: launch to completion of each step's last bucket.",
            hook_labels, registry=r,
        )
        self.step_seconds = Counter(
            Metric.STEP_SECONDS,
            "Seconds those steps took: end of the previous step's last collective to end of the step's last.",
            hook_labels, registry=r,
        )
        self.steps = Counter(
            Metric.STEPS, "Steps whose end wait tensorplay_step_wait_seconds_total counts.", hook_labels, registry=r
        )
        # One timeline per step (docs/telemetry.md, "Busy time and exposed communication").
        self.step_busy, self.step_exposed_communication, self.step_communication = (
            Counter(name, description, hook_labels, registry=r) for name, description in (
                (Metric.STEP_BUSY, "Seconds of this rank's own work in those steps: the previous step's last "
                                   "collective done to the step's last hook call."),
                (Metric.STEP_EXPOSED_COMMUNICATION, "Seconds those steps waited for communication: the last hook "
                                                    "call to the last of their hook futures done."),
                (Metric.STEP_COMMUNICATION, "Seconds of those steps with at least one of their traced collectives in flight."),
            )
        )
        self.last_step_timestamp = Gauge(
            Metric.LAST_STEP_TIMESTAMP, "Unix time of this rank's latest hook call.", rank_label, registry=r
        )
        self.collective_waiting_since = Gauge(
            Metric.COLLECTIVE_WAITING_SINCE,
            "Unix time this rank launched the oldest traced collective still in flight; 0 when none is.",
            rank_label, registry=r,
        )
        self.collectives_in_flight = CollectivesInFlight(self.collective_waiting_since)
        self.join_timestamp = Gauge(
            Metric.JOIN_TIMESTAMP, "Unix time this rank ran out of inputs (latest Join).", rank_label, registry=r
        )
        self.join_shadow_iterations = Gauge(
            Metric.JOIN_SHADOW_ITERATIONS, "Iterations this rank shadowed after joining (latest Join).", rank_label, registry=r
        )
        self.join_wait = Histogram(
            Metric.JOIN_WAIT, "Time from this rank joining until all ranks joined.",
            rank_label, buckets=JOIN_WAIT_BUCKETS, registry=r,
        )
        self.join_last_joiner = Gauge(
            Metric.JOIN_LAST_JOINER, "1 if this rank was among the last to join (latest Join), else 0.", rank_label, registry=r
        )
        self.joins = Counter(Metric.JOINS, "Join contexts completed.", rank_label, registry=r)
        candidate_labels = ("rank", "hook", "candidate")
        self.candidate_error = Gauge(
            Metric.CANDIDATE_ERROR,
            "What the candidate compression would make of this rank's gradients: relative L2 error, latest advised iteration.",
            candidate_labels, registry=r,
        )
        self.candidate_wire = Gauge(
            Metric.CANDIDATE_WIRE,
            "Bytes the candidate compression would send over bytes DDP handed over, latest advised iteration.",
            candidate_labels, registry=r,
        )
        self.candidate_nonfinite = Gauge(
            Metric.CANDIDATE_NONFINITE,
            "Finite gradient elements the candidate compression would make non-finite, latest advised iteration.",
            candidate_labels, registry=r,
        )
        self.telemetry_errors = Counter(
            Metric.TELEMETRY_ERRORS,
            "Telemetry problems that training rode over (port taken, exporter down, a failing listener).",
            ("rank", "reason"), registry=r,
        )
        self.optimizer_steps = Counter(
            Metric.OPTIMIZER_STEPS, "Optimizer steps that updated parameters of a traced DDP model.", rank_label,
            registry=r,
        )
        self.gradient_reductions = Counter(
            Metric.GRADIENT_REDUCTIONS,
            "DDP iterations whose gradients a traced hook reduced (each model's once; not those shadowed in Join).",
            rank_label, registry=r,
        )
        self.unreduced_optimizer_steps = Counter(
            Metric.UNREDUCED_OPTIMIZER_STEPS,
            "Optimizer steps that updated a traced model none of whose gradients were reduced since its previous step.",
            rank_label, registry=r,
        )
        self.replica_fingerprints = ReplicaFingerprints()
        r.register(self.replica_fingerprints)
        self._served = _WithoutCreated(families)
        self.registry.register(self._served)  # after the families: names are checked here
        self._children: dict[tuple[Any, str, str | None], Any] = {}
        self._last_hook_calls: dict[str, LastHookCall] = {}
        self._last_hook_calls_lock = threading.Lock()

    def withdraw(self) -> None:
        """Take these families out of ``registry`` (whose endpoint then no longer serves them)."""
        self.registry.unregister(self._served)

    def child(self, family: Any, rank: str, hook: str | None = None) -> Any:
        """The series of ``family`` for ``rank`` (and ``hook``), looked up once, when first written.

        Every bucket writes up to nine series; ``labels()`` costs several times what the write
        does. Bounded as the labels are (ranks x hooks); a lost race only looks a child up twice.
        """
        key = (family, rank, hook)
        found = self._children.get(key)
        if found is None:
            found = family.labels(rank=rank) if hook is None else family.labels(rank=rank, hook=hook)
            self._children[key] = found
        return found

    def last_hook_call(self, rank: str) -> "LastHookCall":
        """Where the training thread notes ``rank``'s latest hook call; the gauge reads it when scraped.

        A plain attribute write per bucket instead of a gauge update under its lock: the training
        thread pays for every line it runs after a backward pass has evicted the caches.
        """
        found = self._last_hook_calls.get(rank)
        if found is None:
            with self._last_hook_calls_lock:
                found = self._last_hook_calls.get(rank)
                if found is None:
                    found = LastHookCall()
                    self.last_step_timestamp.labels(rank=rank).set_function(found.read)
                    self._last_hook_calls[rank] = found
        return found

    def count_error(self, rank: int, reason: str) -> None:
        """Count a telemetry problem that training went on through."""
        self.telemetry_errors.labels(rank=str(rank), reason=reason).inc()


class ReplicaFingerprints:
    """``tensorplay_replica_fingerprint`` and ``tensorplay_replica_fingerprint_step``, served from one snapshot.

    A fingerprint is compared across ranks only at the same step, so a scrape must never pair a
    new fingerprint with the step of the one before (two gauges are collected one after the
    other, and the training thread may write in between). Each rank's pair is one dict entry,
    replaced whole, and both families are built from one copy of the dict.
    """

    def __init__(self) -> None:
        self._latest: dict[str, tuple[int, int]] = {}

    def set(self, rank: str, step: int, fingerprint: int) -> None:
        """Publish ``rank``'s fingerprint taken after optimizer step ``step``."""
        self._latest[rank] = (step, fingerprint)

    def get(self, rank: str) -> tuple[int, int] | None:
        """``(step, fingerprint)`` last published for ``rank``, or None."""
        return self._latest.get(rank)

    def collect(self) -> Iterator[MetricFamily]:
        latest = self._latest.copy()  # one C call: no write can land between the two families
        fingerprint = GaugeMetricFamily(
            Metric.REPLICA_FINGERPRINT,
            "Fingerprint of the traced models' parameters right after optimizer step "
            f"{Metric.REPLICA_FINGERPRINT_STEP}: equal on ranks whose replicas are equal.",
            labels=("rank",),
        )
        step = GaugeMetricFamily(
            Metric.REPLICA_FINGERPRINT_STEP, "The optimizer step (per process, from 1) the fingerprint was taken after.",
            labels=("rank",),
        )
        for rank, (at, value) in latest.items():
            fingerprint.add_metric((rank,), float(value))
            step.add_metric((rank,), float(at))
        yield fingerprint
        yield step

    def describe(self) -> list[MetricFamily]:
        return list(self.collect())


class LastHookCall:
    """The Unix time of a rank's latest hook call, as the training thread last wrote it."""

    __slots__ = ("unix_s",)

    def __init__(self) -> None:
        self.unix_s = 0.0

    def read(self) -> float:
        return self.unix_s


_lock = threading.Lock()
_active: TensorplayMetrics | None = None
_server: MetricsServer | None = None
_env_checked = False


def enable_metrics(
    port: int | None = None,
    addr: str | None = None,
    registry: CollectorRegistry | None = None,
    serve: bool = True,
) -> TensorplayMetrics:
    """Turn tensorplay's metrics on for this process and serve them on ``/metrics``.

    Arguments:
        port: base port; this rank serves on ``port + LOCAL_RANK``. Default: the
            ``TENSORPLAY_METRICS_PORT`` environment variable, else 9400.
        addr: address to bind. Default: ``TENSORPLAY_METRICS_ADDR``, else ``0.0.0.0`` (all
            interfaces, so Prometheus can scrape pods and nodes); use ``127.0.0.1`` on a laptop.
        registry: where the metric families live (tests pass a fresh ``CollectorRegistry()``;
            pass ``prometheus_client.REGISTRY`` with ``serve=False`` to use your own endpoint).
        serve: start the HTTP endpoint. A port that is taken gives a warning, is counted in
            ``tensorplay_telemetry_errors_total{reason="metrics_port_unavailable"}``, and training
            goes on with metrics collected but not served. So does a port that is no port (not a
            whole number, or outside 0-65535 once ``LOCAL_RANK`` is added), counted as
            ``reason="metrics_port_invalid"``; the warning names the value and where it came from.

    Calling it again returns the metrics already enabled.
    """
    global _active, _server
    with _lock:
        if _active is not None:
            return _active
        metrics = TensorplayMetrics(registry)
        if serve:
            _server = _serve(metrics, port, addr)
        # In no collective yet: the series exists from the start, so a rank stuck before its
        # first collective is still seen as outside one.
        metrics.collective_waiting_since.labels(rank=rank_label()).set(0)
        _active = metrics
    return metrics


def _serve(metrics: TensorplayMetrics, port: int | None, addr: str | None) -> MetricsServer | None:
    """Start the endpoint on ``port + LOCAL_RANK``; warn, count and return None where that cannot be."""
    bind = addr if addr is not None else (os.environ.get(ADDR_ENV) or DEFAULT_METRICS_ADDR)
    real_port, problem = _port_to_serve(port)
    if real_port is None:
        _warn_not_served(f"{problem}; use a port in 1-65535", metrics, "metrics_port_invalid")
        return None
    try:
        return MetricsServer(metrics.registry, bind, real_port)
    except (OSError, OverflowError) as error:
        _warn_not_served(f"cannot serve metrics on {bind}:{real_port} ({error})", metrics, "metrics_port_unavailable")
        return None


def _port_to_serve(port: int | None) -> tuple[int | None, str]:
    """The port this rank serves on (base + LOCAL_RANK), or None and what is wrong with it."""
    if port is not None:
        base, source = port, f"port={port!r}"
    else:
        raw = (os.environ.get(PORT_ENV) or "").strip()
        base, source = (_whole_number(raw), f"{PORT_ENV}={os.environ.get(PORT_ENV)!r}") if raw else (DEFAULT_METRICS_PORT, "")
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base <= 65535:
        return None, f"{source} is not a port number"
    local_rank = _whole_number(os.environ.get("LOCAL_RANK", "0").strip() or "0")
    if local_rank is None:
        return None, f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r} is not a whole number"
    if base + local_rank > 65535:
        given = f"{source} + " if source else f"the default {base} + "
        return None, f"port {base + local_rank} ({given}LOCAL_RANK={local_rank}) is above 65535"
    return base + local_rank, ""


def _whole_number(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 0 else None


def _warn_not_served(problem: str, metrics: TensorplayMetrics, reason: str) -> None:
    warnings.warn(
        f"tensorplay: {problem}; training goes on, metrics are collected but not served",
        RuntimeWarning,
        stacklevel=4,
    )
    metrics.count_error(_rank(), reason)


def disable_metrics() -> None:
    """Turn metrics off: stop serving them and take tensorplay's families out of their registry.

    Where that registry is the application's own (``enable_metrics(registry=prometheus_client.REGISTRY,
    serve=False)``), its endpoint then no longer serves tensorplay's last values, frozen, and
    :func:`enable_metrics` may register fresh families there again.
    """
    global _active, _server
    with _lock:
        if _server is not None:
            _server.close()
        if _active is not None:
            _active.withdraw()
        _active = None
        _server = None


def active_metrics() -> TensorplayMetrics | None:
    """Return the enabled metrics, enabling them first if the environment asks for it."""
    global _env_checked
    if _active is None and not _env_checked:
        _env_checked = True
        if (os.environ.get(PORT_ENV) or "").strip():
            try:
                enable_metrics()
            except Exception:  # a bad environment value must not stop training
                _logger.exception("tensorplay: could not enable metrics from %s", PORT_ENV)
    return _active


def wait_for_final_scrape(timeout_s: float | None = None) -> bool:
    """Keep serving until every Prometheus scraping this rank has read it once more; True once they have.

    Call it at the very end of a job (after :func:`~tensorplay.telemetry.flush`), so the last
    values -- the final ``Join`` figures above all -- reach Prometheus before the process exits.
    It waits until each scraper still scraping the rank (an HA pair's two replicas, Prometheus
    and an agent: see :class:`~tensorplay.telemetry.server.ScrapeLog`) has completed a scrape
    (one carrying ``X-Prometheus-Scrape-Timeout-Seconds``) that started after the call, at most
    ``timeout_s`` seconds; by default 1.5 times the longest scrape interval among them plus a
    second (intervals from when their scrapes started), or a minute for a scraper seen to start
    one scrape only. It returns False when the time ran out (a scraper went away), and at once
    when nothing is served or Prometheus never scraped this rank: there is nobody to wait for.
    """
    server = _server
    if server is None or not server.scrapes.seen():
        return False
    return server.scrapes.wait_for_next(timeout_s)


def served_address() -> tuple[str, int] | None:
    """Return the (host, port) the endpoint listens on, or None when nothing is served."""
    return _server.address if _server is not None else None


def _forget_the_parents_metrics() -> None:
    """In a forked child: start as a fresh process would, with metrics off and no endpoint.

    The parent's server thread did not come along, so its server object serves nothing; its
    listening socket is closed here so the child does not hold the parent's port. The parent's
    families leave the registry they were in: where that is the application's own
    (``enable_metrics(registry=prometheus_client.REGISTRY)``), the child's endpoint would serve
    the parent's frozen counts, and the child's own ``enable_metrics`` could not register its
    families beside them (``Duplicated timeseries``). The child turns metrics on again as any
    process does (``enable_metrics``, or ``TENSORPLAY_METRICS_PORT``).
    """
    global _lock, _active, _server, _env_checked
    _lock = threading.Lock()
    if _server is not None:
        _server.abandon()
    if _active is not None:
        _active.withdraw()
    _active = None
    _server = None
    _env_checked = False


os.register_at_fork(after_in_child=_forget_the_parents_metrics)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def rank_label() -> str:
    """This process's global rank as a label value."""
    return str(_rank())
