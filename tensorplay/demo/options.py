"""The training job's flags, shared by ``tensorplay demo`` and the per-rank entry point.

``tensorplay demo`` parses them, checks them against its ``--world-size`` and hands them on to
every rank unchanged; under ``torchrun`` the entry point parses and checks the same flags itself.
"""

from __future__ import annotations

import argparse
import os

from tensorplay.telemetry.metrics import PORT_ENV

from .hooks import DEFAULT_HOOK, HOOK_NAMES

__all__ = [
    "add_job_arguments",
    "job_problem",
    "job_argv",
    "extra_batches",
    "DEFAULT_STEPS",
    "DEFAULT_BATCH",
    "DEFAULT_STRAGGLER_DELAY_MS",
    "DEFAULT_STRAGGLER_BATCH_FACTOR",
    "STRAGGLER_KINDS",
    "DEFAULT_STALL_TIMEOUT_S",
    "NO_SYNC_BUGS",
    "hang_step",
    "accumulation_steps",
    "DEFAULT_ADVISE_EVERY",
]

DEFAULT_STEPS = 40
DEFAULT_BATCH = 32
DEFAULT_STRAGGLER_DELAY_MS = 40.0
DEFAULT_STRAGGLER_BATCH_FACTOR = 16
STRAGGLER_KINDS = ("sleep", "batch")
DEFAULT_STALL_TIMEOUT_S = 60.0
NO_SYNC_BUGS = ("backward-only", "never-ends")
BACKWARD_ONLY_ACCUMULATION = 4
DEFAULT_ADVISE_EVERY = 5
"""The demo advises one step in 5 (steps 4, 9, ...): the library's default, 250, would advise no step of a
demo run (the demo model's gradients are 2.6 MB, a small copy per advised step)."""
_HOOKS_ON_A_PROCESS_GROUP = ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
                             "fp16_compress_wrapper(allreduce_hook)", "bf16_compress_wrapper(allreduce_hook)")


def hang_step(args: argparse.Namespace) -> int:
    """The step at which ``--hang-rank`` stops: ``--hang-at-step``, else half of ``--steps``."""
    return args.hang_at_step if args.hang_at_step is not None else args.steps // 2


def accumulation_steps(args: argparse.Namespace) -> int:
    """Micro-batches per optimizer step: ``--accumulation-steps``, else 4 for ``--no-sync-bug backward-only``, else 1."""
    if args.accumulation_steps is not None:
        return args.accumulation_steps
    return BACKWARD_ONLY_ACCUMULATION if args.no_sync_bug == "backward-only" else 1


def extra_batches(steps: int) -> int:
    """With ``--uneven``, rank r trains ``steps + r * extra_batches(steps)`` batches."""
    return max(1, steps // 4)


def add_job_arguments(parser: argparse.ArgumentParser, metrics_addr: str | None = None) -> None:
    """Add the flags of the training job itself (everything but how many ranks to start).

    ``metrics_addr`` is ``--metrics-addr``'s default (``tensorplay demo``: loopback); None leaves
    it to ``enable_metrics``: ``$TENSORPLAY_METRICS_ADDR``, else 0.0.0.0.
    """
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="S",
                        help=f"batches per rank (with --uneven, rank 0's count; default {DEFAULT_STEPS})")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, metavar="B",
                        help=f"extra flag: samples per batch on every rank (default {DEFAULT_BATCH}); a bigger "
                             "batch everywhere makes a uniformly slow job")
    parser.add_argument("--hook", default=DEFAULT_HOOK, choices=HOOK_NAMES, metavar="NAME",
                        help=f"communication hook, registered as traced(NAME): {', '.join(HOOK_NAMES)} "
                             f"(default {DEFAULT_HOOK})")
    parser.add_argument("--straggler-rank", type=int, default=None, metavar="R",
                        help="make rank R a straggler: it sleeps in its compute every step")
    parser.add_argument("--straggler-delay-ms", type=float, default=DEFAULT_STRAGGLER_DELAY_MS, metavar="D",
                        help=f"how long the straggler sleeps per step (default {DEFAULT_STRAGGLER_DELAY_MS:g})")
    parser.add_argument("--straggler-kind", choices=STRAGGLER_KINDS, default="sleep",
                        help="extra flag: how the straggler is slow: 'sleep' sleeps --straggler-delay-ms between "
                             "forward and backward; 'batch' trains a batch --straggler-batch-factor times its "
                             "peers' (more forward work, which its compute time shows, and more backward work between the "
                             "buckets, which it does not; default sleep)")
    parser.add_argument("--straggler-batch-factor", type=int, default=DEFAULT_STRAGGLER_BATCH_FACTOR, metavar="F",
                        help="extra flag: with --straggler-kind batch, the straggler's batch is F times its peers' "
                             f"(default {DEFAULT_STRAGGLER_BATCH_FACTOR})")
    parser.add_argument("--uneven", action="store_true",
                        help="uneven inputs: rank r trains S + r*max(1, S//4) batches, inside Join([ddp_model])")
    parser.add_argument("--accumulation-steps", type=int, default=None, metavar="K",
                        help="extra flag: accumulate gradients over K batches per optimizer step, the first K-1 "
                             "inside DDP's no_sync() (forward and backward), as it should be: one gradient reduction "
                             f"per step (default 1; {BACKWARD_ONLY_ACCUMULATION} with --no-sync-bug backward-only)")
    parser.add_argument("--no-sync-bug", choices=NO_SYNC_BUGS, default=None,
                        help="extra flag: get no_sync() wrong, to watch tensorplay see it: 'backward-only' wraps "
                             "only the backward of the accumulated batches (it takes no effect: every batch is "
                             "reduced); 'never-ends' enters no_sync() after the first optimizer step and never "
                             "leaves it (no gradient is reduced again: the replicas drift apart)")
    parser.add_argument("--hang-rank", type=int, default=None, metavar="R",
                        help="make rank R stop for good in its compute at step K, as a stuck data loader would")
    parser.add_argument("--hang-at-step", type=int, default=None, metavar="K",
                        help="the step at which --hang-rank stops (default: half of --steps)")
    parser.add_argument("--hang-inside-collective", action="store_true",
                        help="extra flag: --hang-rank blocks inside a traced collective its peers never join "
                             "(every rank then waits in one: no rank to blame); default hooks only")
    parser.add_argument("--advise-every", type=int, default=DEFAULT_ADVISE_EVERY, metavar="N",
                        help="extra flag: take the compression advice on one step in N, steps N-1, 2N-1, ... "
                             "(traced(hook, advise_every=N); 0: never; default "
                             f"{DEFAULT_ADVISE_EVERY}, where the library's is 250)")
    parser.add_argument("--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="T",
                        help="when no rank made progress for T seconds, print a hang report, stop every rank "
                             f"and exit 3 (default {DEFAULT_STALL_TIMEOUT_S:g})")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="rank serves /metrics on P + LOCAL_RANK (default $TENSORPLAY_METRICS_PORT, else 9400)")
    parser.add_argument("--metrics-addr", default=metrics_addr, metavar="ADDR",
                        help="extra flag: address the metrics endpoints bind (default "
                             + (metrics_addr or "$TENSORPLAY_METRICS_ADDR, else 0.0.0.0") + ")")
    parser.add_argument("--otlp-endpoint", default=None, metavar="URL",
                        help="also export spans over OTLP to URL (default $OTEL_EXPORTER_OTLP_ENDPOINT if set)")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="extra flag: where spans, per-rank results and logs go "
                             "(tensorplay demo: a new or empty directory; default a fresh temporary one)")
    parser.add_argument("--linger-s", type=float, default=0.0, metavar="SECONDS",
                        help="extra flag: keep each rank and its metrics endpoint up this long after training, "
                             "for a last scrape (default 0)")


def job_problem(args: argparse.Namespace, world_size: int, local_world_size: int) -> str | None:
    """Say what is wrong with the job's flags, or None if nothing is.

    ``world_size`` ranks in all, ``local_world_size`` of them on this node (each serves metrics
    on its own port).
    """
    if args.steps < 1:
        return f"--steps must be at least 1, got {args.steps}"
    if args.batch_size < 1:
        return f"--batch-size must be at least 1, got {args.batch_size}"
    if args.straggler_rank is not None:
        if world_size < 2:
            return "--straggler-rank needs peers to straggle behind: use --world-size 2 or more"
        if not 0 <= args.straggler_rank < world_size:
            return (f"--straggler-rank {args.straggler_rank} is not a rank of this job "
                    f"(--world-size {world_size} has ranks 0..{world_size - 1})")
    if args.straggler_delay_ms < 0:
        return f"--straggler-delay-ms must be >= 0, got {args.straggler_delay_ms:g}"
    if args.straggler_batch_factor < 1:
        return f"--straggler-batch-factor must be at least 1, got {args.straggler_batch_factor}"
    if args.accumulation_steps is not None and args.accumulation_steps < 1:
        return f"--accumulation-steps must be at least 1, got {args.accumulation_steps}"
    if args.no_sync_bug == "backward-only" and accumulation_steps(args) < 2:
        return "--no-sync-bug backward-only needs batches to accumulate: --accumulation-steps 2 or more"
    problem = _port_problem(args, local_world_size)
    if problem is not None:
        return problem
    if args.linger_s < 0:
        return f"--linger-s must be >= 0, got {args.linger_s:g}"
    if args.advise_every < 0:
        return f"--advise-every must be >= 0 (0: never), got {args.advise_every}"
    if args.stall_timeout_s <= 0:
        return f"--stall-timeout-s must be > 0, got {args.stall_timeout_s:g}"
    return _hang_problem(args, world_size)


def _port_problem(args: argparse.Namespace, local_world_size: int) -> str | None:
    """``--metrics-port``, or ``$TENSORPLAY_METRICS_PORT`` standing in for it, checked alike: a rank
    would otherwise train without serving, and say so only in its log."""
    port, source = args.metrics_port, f"--metrics-port {args.metrics_port}"
    raw = (os.environ.get(PORT_ENV) or "").strip()
    if port is None and raw:
        source = f"{PORT_ENV}={raw!r} (the default of --metrics-port)"
        try:
            port = int(raw)
        except ValueError:
            return f"{source} is not a port number"
    if port is not None and not 0 < port <= 65536 - local_world_size:
        return (f"{source}: the ranks serve on ports {port}..{port + local_world_size - 1}, "
                "which must lie within 1..65535")
    return None


def _hang_problem(args: argparse.Namespace, world_size: int) -> str | None:
    if args.hang_rank is None:
        if args.hang_at_step is not None or args.hang_inside_collective:
            return "--hang-at-step and --hang-inside-collective need --hang-rank"
        return None
    if world_size < 2:
        return "--hang-rank needs peers to wait for it: use --world-size 2 or more"
    if not 0 <= args.hang_rank < world_size:
        return (f"--hang-rank {args.hang_rank} is not a rank of this job "
                f"(--world-size {world_size} has ranks 0..{world_size - 1})")
    if not 0 <= hang_step(args) < args.steps:
        return f"--hang-at-step must lie within 0..{args.steps - 1} (the steps every rank trains), got {hang_step(args)}"
    if args.hang_inside_collective and args.hook not in _HOOKS_ON_A_PROCESS_GROUP:
        return f"--hang-inside-collective works with {', '.join(_HOOKS_ON_A_PROCESS_GROUP)}, not {args.hook}"
    return None


def job_argv(args: argparse.Namespace) -> list[str]:
    """Turn parsed job flags back into the command line every rank gets."""
    argv = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--hook", args.hook,
            "--straggler-delay-ms", repr(args.straggler_delay_ms), "--straggler-kind", args.straggler_kind,
            "--straggler-batch-factor", str(args.straggler_batch_factor), "--linger-s", repr(args.linger_s),
            "--advise-every", str(args.advise_every)]
    optional = {
        "--straggler-rank": args.straggler_rank,
        "--hang-rank": args.hang_rank,
        "--hang-at-step": args.hang_at_step,
        "--accumulation-steps": args.accumulation_steps,
        "--no-sync-bug": args.no_sync_bug,
        "--metrics-port": args.metrics_port,
        "--metrics-addr": args.metrics_addr,
        "--otlp-endpoint": args.otlp_endpoint,
        "--run-dir": args.run_dir,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if args.uneven:
        argv.append("--uneven")
    if args.hang_inside_collective:
        argv.append("--hang-inside-collective")
    return argv
