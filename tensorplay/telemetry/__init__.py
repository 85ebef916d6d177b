"""Turns what the algorithms report into OpenTelemetry spans and Prometheus metrics."""
