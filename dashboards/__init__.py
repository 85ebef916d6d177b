"""Grafana dashboards as code: the JSON files here are written by ``python -m dashboards.generate``."""
