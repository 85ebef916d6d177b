"""What importing tensorplay costs and registers: each check in a fresh interpreter, as a user's script starts."""

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import tensorplay

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "opentelemetry", "prometheus_client", "matplotlib")


def _run(script: str) -> None:
    """Run ``script`` in a fresh interpreter; its failed assertion fails the test with its output."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_analysis_and_report_import_neither_torch_nor_the_telemetry() -> None:
    _run(
        "import sys, tensorplay.analysis, tensorplay.report\n"
        f"loaded = sorted({{m for m in sys.modules if m.split('.')[0] in {HEAVY!r}}} | {{m for m in sys.modules if m.startswith('tensorplay.telemetry')}})\n"
        "assert not loaded, [m for m in loaded if m.count('.') < 2]\n"
    )


def test_the_algorithms_load_only_the_probe_and_nobody_listens_to_join() -> None:
    """Join's quiet branch (no clock read) is the one that runs until the telemetry is used."""
    _run(
        "import sys\n"
        "import tensorplay.distributed.algorithms.join, tensorplay.distributed.algorithms.ddp_comm_hooks as hooks\n"
        "from tensorplay.telemetry import probe\n"
        "telemetry = sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'prometheus_client', 'tensorplay.telemetry.')))\n"
        "assert telemetry == ['tensorplay.telemetry.probe'], telemetry\n"
        "assert not probe.join_listening()\n"
        "from tensorplay import traced\n"
        "assert probe.join_listening(), 'using the telemetry exports Join timing'\n"
        "import tensorplay.telemetry, tensorplay.telemetry.traced as module\n"
        "assert traced is hooks.traced is tensorplay.telemetry.traced and callable(traced), (traced, hooks.traced)\n"
    )


def test_traced_stays_the_function_after_its_module_is_imported_first() -> None:
    _run(
        "from tensorplay.telemetry.traced import Hook\n"
        "import tensorplay.telemetry.traced\n"
        "from tensorplay.telemetry import probe, traced\n"
        "assert traced.__module__ == 'tensorplay.telemetry.traced' and callable(traced), traced\n"
        "assert probe.join_listening()\n"
    )


def test_the_tracing_module_imports_first_and_the_package_imports_no_telemetry() -> None:
    """No import cycle: tracing.py reads the version from a package that imports nothing back."""
    _run("import tensorplay.telemetry.tracing")
    _run("import sys, tensorplay\nloaded = [m for m in sys.modules if m.startswith('tensorplay.')]\nassert not loaded, loaded")


def test_the_version_is_written_once_in_pyproject() -> None:
    written = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tensorplay.__version__ == metadata.version("tensorplay") == written
