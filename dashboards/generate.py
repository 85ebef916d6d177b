"""Write dashboards/*.json, Grafana's provisioned dashboards, from the Python beside them.

Run from the repository root after editing communication.py, stragglers_join.py or blocks.py
(tests/test_dashboards.py fails while a JSON file differs from what this writes):

    python -m dashboards.generate

Why not grafana-foundation-sdk: its Dashboard builder has no setter for ``schemaVersion`` (the
model writes 36; these dashboards are 39), its variable model has no ``definition`` and writes the
interval variables' ``auto``, ``auto_min`` and ``auto_count`` into every variable, every panel
gains ``transparent`` and ``repeatDirection``; the release pip picks by default (10.1.0) cannot
set the stat's ``wideLayout``/``showPercentChange``, the bar gauge's ``namePlacement``/``sizing``
or the heatmap tooltip's ``showColorScale``. What these two dashboards need is plain JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from . import communication, stragglers_join

HERE = Path(__file__).resolve().parent
DASHBOARDS: dict[str, Callable[[], dict]] = {
    "communication.json": communication.build,
    "stragglers-join.json": stragglers_join.build,
}


def render(name: str) -> str:
    """The text of dashboards/``name``: the dashboard as JSON, two-space indented, UTF-8."""
    return json.dumps(DASHBOARDS[name](), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    for name in DASHBOARDS:
        path = HERE / name
        path.write_text(render(name), encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
