"""tensorplay: PyTorch DDP communication hooks and Join, observable through OpenTelemetry and Prometheus."""

__version__ = "0.1.0"

from tensorplay.telemetry.traced import traced  # noqa: E402  (needs __version__ above)

__all__ = ["__version__", "traced"]
