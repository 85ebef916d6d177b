"""Benchmark: ``tensorplay report`` on a large run, 64 ranks x 1,000 steps x 10 buckets by default.

Writes synthetic span files shaped exactly like a real run's: one hook span and one join span are
exported through tensorplay's own ``JsonLinesSpanExporter`` and the OpenTelemetry SDK, and every
other line is a copy of those with its own times, ids and attribute values (the attribute names
are tensorplay's constants). The run has a story to draw: one rank straggles from a third of the
way on, one bucket is always slower, the compression error drifts, and a few ranks run out of
inputs near the end. Then times the command as a user runs it (``python -m tensorplay report``,
a fresh process each time: start-up and imports included), interleaved with the same command on a
tiny run (the fixed cost), and prints medians with their spread, the large run's extra cost, one
in-process run's split by stage, the page's size and the peak memory.

    python bench/report_at_scale.py [--ranks 64] [--steps 1000] [--buckets 10] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tensorplay.report import plots  # noqa: F401  (matplotlib is loaded before anything is timed)
from tensorplay.report.build import render_html, report_from_spans
from tensorplay.analysis.span_reader import read_spans
from tensorplay.telemetry import DEFAULT_ERROR_EVERY
from tensorplay.telemetry.names import HOOK_SPAN_NAME, JOIN_SPAN_NAME, TRACER_NAME, Attr
from tensorplay.telemetry.tracing import JsonLinesSpanExporter

HOOK = "fp16_compress_hook"
BUCKET_NUMEL = 655_360
COMPUTE_MS = 20.0
STRAGGLER_EXTRA_MS = 30.0
SLOW_BUCKET_EXTRA_MS = 2.0


def _templates(directory: Path) -> tuple[dict, dict]:
    """One hook span and one join span as the real exporter writes them, parsed."""
    path = directory / "template.jsonl"
    provider = TracerProvider(resource=Resource.create({"tensorplay.rank": 0, "tensorplay.world_size": 2,
                                                        "service.name": "tensorplay"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    tracer = provider.get_tracer(TRACER_NAME)
    hook = tracer.start_span(HOOK_SPAN_NAME)
    hook.set_attributes({
        Attr.HOOK: HOOK, Attr.RANK: 0, Attr.WORLD_SIZE: 2, Attr.STEP: 0, Attr.BUCKET_INDEX: 0,
        Attr.BUCKET_NUMEL: BUCKET_NUMEL, Attr.BUCKET_BYTES: 4 * BUCKET_NUMEL, Attr.BUCKET_WIRE_BYTES: 2 * BUCKET_NUMEL,
        Attr.BUCKET_DTYPE: "float32", Attr.COMPRESSION_NONFINITE: 0, Attr.ALLREDUCE_LATENCY_MS: 1.0,
        Attr.ALLREDUCE_COUNT: 1, Attr.COMPRESSION_DTYPE: "float16", Attr.BUCKET_NONFINITE: 0,
        Attr.COMPRESSION_RELATIVE_ERROR: 5e-4,
    })
    hook.end()
    join = tracer.start_span(JOIN_SPAN_NAME)
    join.set_attributes({Attr.RANK: 0, Attr.WORLD_SIZE: 2, Attr.JOIN_SHADOW_ITERATIONS: 0, Attr.JOIN_WAIT_MS: 0.0,
                         Attr.JOIN_LAST_JOINER: True})
    join.end()
    provider.shutdown()
    hook_line, join_line = path.read_text().splitlines()
    path.unlink()
    return json.loads(hook_line), json.loads(join_line)


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _span(template: dict, rng: random.Random, start_s: float, end_s: float, attributes: dict) -> str:
    span = dict(template, start_time=_iso(start_s), end_time=_iso(end_s), attributes=attributes)
    span["context"] = dict(template["context"], trace_id=f"0x{rng.getrandbits(128):032x}",
                           span_id=f"0x{rng.getrandbits(64):016x}")
    return json.dumps(span)


def write_run(directory: Path, ranks: int, steps: int, buckets: int) -> int:
    """Write ``spans-rank<r>.jsonl`` for every rank; return the number of bytes written.

    Times follow how DDP runs: a rank's step starts when its previous step's last collective
    completed, its first hook call comes after its compute, and each bucket's allreduce completes
    when the last rank has launched it, so the others' latency includes waiting for a slow rank.
    """
    hook_template, join_template = _templates(directory)
    rng = random.Random(0)
    straggler, straggles_from = ranks // 4 + 1, steps // 3
    slow_bucket = buckets // 3
    early = range(min(4, ranks - 1))  # these ranks run out of inputs 5% before the end, inside Join
    trained = [steps - steps // 20 if rank in early else steps for rank in range(ranks)]
    templates = []
    for rank in range(ranks):
        resource = dict(hook_template["resource"],
                        attributes=dict(hook_template["resource"]["attributes"],
                                        **{"tensorplay.rank": rank, "tensorplay.world_size": ranks}))
        templates.append((dict(hook_template, resource=resource), dict(join_template, resource=resource)))
    files = [(directory / f"spans-rank{rank}.jsonl").open("w") for rank in range(ranks)]
    previous_end_s = [1.8e9] * ranks
    joined_s = [0.0] * ranks
    written = 0
    for step in range(steps):
        launches = []
        for rank in range(ranks):
            if step == trained[rank]:
                joined_s[rank] = previous_end_s[rank]
            compute_ms = COMPUTE_MS * rng.uniform(0.9, 1.1) if step < trained[rank] else 0.5
            if rank == straggler and step >= straggles_from:
                compute_ms += STRAGGLER_EXTRA_MS
            launches.append(previous_end_s[rank] + compute_ms / 1e3)
        done_s = []
        for bucket in range(buckets):
            transfer_ms = 1.0 + rng.expovariate(2.0) + (SLOW_BUCKET_EXTRA_MS if bucket == slow_bucket else 0.0)
            done_s.append(max(launches) + bucket * 2e-4 + transfer_ms / 1e3)
        for rank in range(ranks):
            hook = templates[rank][0]
            lines = []
            for bucket in range(buckets):
                start_s = launches[rank] + bucket * 2e-4
                attributes = {
                    Attr.HOOK: HOOK, Attr.RANK: rank, Attr.WORLD_SIZE: ranks, Attr.STEP: step,
                    Attr.BUCKET_INDEX: bucket, Attr.BUCKET_NUMEL: BUCKET_NUMEL,
                    Attr.BUCKET_BYTES: 4 * BUCKET_NUMEL, Attr.BUCKET_WIRE_BYTES: 2 * BUCKET_NUMEL,
                    Attr.BUCKET_DTYPE: "float32", Attr.COMPRESSION_NONFINITE: 0,
                    Attr.ALLREDUCE_LATENCY_MS: (done_s[bucket] - start_s) * 1e3, Attr.ALLREDUCE_COUNT: 1,
                    Attr.COMPRESSION_DTYPE: "float16", Attr.BUCKET_NONFINITE: 0,
                }
                if step % DEFAULT_ERROR_EVERY == 0:  # drifting up over the run
                    drift = 1 + step / steps
                    attributes[Attr.COMPRESSION_RELATIVE_ERROR] = 4.9e-4 * drift * rng.uniform(0.95, 1.05)
                lines.append(_span(hook, rng, start_s, done_s[bucket], attributes))
            text = "\n".join(lines) + "\n"
            files[rank].write(text)
            written += len(text)
            previous_end_s[rank] = max(done_s)
    for rank, sink in enumerate(files):
        join = templates[rank][1]
        start_s = joined_s[rank] if trained[rank] < steps else previous_end_s[rank]
        text = _span(join, rng, start_s, previous_end_s[rank], {
            Attr.RANK: rank, Attr.WORLD_SIZE: ranks, Attr.JOIN_SHADOW_ITERATIONS: steps - trained[rank],
            Attr.JOIN_WAIT_MS: (previous_end_s[rank] - start_s) * 1e3, Attr.JOIN_LAST_JOINER: rank not in early,
        }) + "\n"
        sink.write(text)
        sink.close()
        written += len(text)
    return written


def _stages(directory: Path) -> dict[str, float]:
    """One report in-process, timed by stage (matplotlib already imported)."""
    started = time.perf_counter()
    spans = read_spans(directory)
    read = time.perf_counter()
    report = report_from_spans(directory, spans)
    drawn = time.perf_counter()
    render_html(report)
    rendered = time.perf_counter()
    return {"read spans": read - started, "aggregate + figures": drawn - read, "PNG + HTML": rendered - drawn}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--buckets", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="write the run (and its report) here and keep it")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tensorplay-report-bench-") as scratch:
        directory = args.keep if args.keep is not None else Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        size = write_run(directory, args.ranks, args.steps, args.buckets)
        print(f"{args.ranks} ranks x {args.steps} steps x {args.buckets} buckets: "
              f"{args.ranks * args.steps * args.buckets:,} hook spans + {args.ranks} join spans, "
              f"{size / 1e6:.0f} MB of JSON lines in {args.ranks} files "
              f"(written in {time.perf_counter() - started:.0f} s)")

        # The same command on a tiny run, interleaved with the large one: its time is the fixed cost
        # (interpreter, torch and matplotlib imports, five figures), the difference is the run's size.
        tiny = directory / "tiny"
        tiny.mkdir(exist_ok=True)
        write_run(tiny, 2, 10, 2)
        times: dict[Path, list[float]] = {tiny: [], directory: []}
        for _ in range(args.repeats):
            for run in times:
                command = [sys.executable, "-m", "tensorplay", "report", str(run)]
                started = time.perf_counter()
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
                times[run].append(time.perf_counter() - started)
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        for run, label in ((tiny, "2 ranks x 10 steps x 2 buckets"), (directory, "the large run")):
            runs = times[run]
            print(f"python -m tensorplay report, {label}, {args.repeats} runs: "
                  f"median {statistics.median(runs):.1f} s (min {min(runs):.1f}, max {max(runs):.1f})")
        extra = statistics.median(large - small for small, large in zip(times[tiny], times[directory]))
        print(f"the large run costs {extra:.1f} s more than the tiny one (median of the paired differences); "
              f"peak memory {peak_mb:.0f} MB; report.html {(directory / 'report.html').stat().st_size / 1e6:.2f} MB")
        stages = _stages(directory)
        print("one run in-process, by stage: "
              + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in stages.items()))


if __name__ == "__main__":
    main()
