"""Analyses shared by the demo's report, ``tensorplay report`` and the alert rules' documentation."""
