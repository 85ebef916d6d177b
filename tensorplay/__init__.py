"""tensorplay: PyTorch DDP communication hooks and Join, observable through OpenTelemetry and Prometheus."""

__version__ = "0.1.0"

__all__ = ["__version__"]
