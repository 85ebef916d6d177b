"""The files one demo run leaves in its run directory, and how they are written and read.

Each rank writes its own files, so no two processes ever append to the same one:
``progress-rank<r>.json`` (rewritten every step, polled by the launcher),
``state-rank<r>.json`` (rewritten from the live telemetry by a thread, for the hang watch),
``result-rank<r>.json`` (once, at the end), ``spans-rank<r>.jsonl`` (the exported spans),
and torch's elastic launcher puts each rank's stdout/stderr under ``logs/``. Rank 0 writes the
per-rank report, ``report.txt``, from the rows every rank sent it.

File names carry the global rank, so on several nodes each node's run dir holds its own ranks'
files, and the run dirs of all nodes can be merged into one (or be one shared directory).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["RunDir", "write_json", "read_json"]


class RunDir:
    """Paths and JSON helpers of one run directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def progress(self, rank: int) -> Path:
        """Where rank ``rank`` reports how far it got."""
        return self.path / f"progress-rank{rank}.json"

    def state(self, rank: int) -> Path:
        """Where rank ``rank``'s collective state is kept current, even while it is blocked."""
        return self.path / f"state-rank{rank}.json"

    def result(self, rank: int) -> Path:
        """Where rank ``rank`` leaves what it measured once training ended."""
        return self.path / f"result-rank{rank}.json"

    def results(self) -> dict[int, dict[str, Any]]:
        """Every result in the directory, by rank (this node's ranks, or every node's in a shared one)."""
        found: dict[int, dict[str, Any]] = {}
        for path in sorted(self.path.glob("result-rank*.json")):
            result = read_json(path)
            if isinstance(result, dict) and isinstance(result.get("rank"), int):
                found[result["rank"]] = result
        return found

    def spans(self, rank: int) -> Path:
        """The JSON-lines file rank ``rank`` exports its spans to."""
        return self.path / f"spans-rank{rank}.jsonl"

    @property
    def report(self) -> Path:
        """The per-rank report as text, written by rank 0 once every rank finished training."""
        return self.path / "report.txt"

    @property
    def logs(self) -> Path:
        """Where the elastic launcher redirects the ranks' stdout and stderr."""
        return self.path / "logs"

    def stderr_logs(self) -> dict[int, Path]:
        """Each local rank's stderr log of the latest attempt, by local rank."""
        logs: dict[int, Path] = {}
        for log in sorted(self.logs.glob("*/attempt_*/*/stderr.log")):
            logs[int(log.parent.name)] = log
        return logs

    def is_unused(self) -> bool:
        """Whether the directory is missing or empty (a run never mixes with an older one)."""
        return not self.path.exists() or (self.path.is_dir() and not any(self.path.iterdir()))


def write_json(path: Path, value: Any) -> None:
    """Replace ``path`` with ``value`` atomically, so a reader never sees half a file.

    The temporary file is this process's and thread's own, so two writers of one path never
    write into, or move, each other's half-written file: the last replace wins, whole.
    """
    partial = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    partial.write_text(json.dumps(value), encoding="utf-8")
    os.replace(partial, path)


def read_json(path: Path) -> Any | None:
    """Return the JSON value at ``path``, or None if it is not there (yet) or cannot be read whole.

    Pollers call it again on their next tick, so a file that is missing or torn (written by
    something other than :func:`write_json`) costs them one tick, never their thread.
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
