"""The communication figures in words, once for the demo's text and ``tensorplay report``'s page.

One sentence for the job (what communication exposes of its step, the share hidden, what
compression could win back at most, or that it will not pay); the candidates of the advice as
table cells; and the notes beside that table: what its columns mean and the model the estimate
rests on, or how to get advice when the run took none.
"""

from __future__ import annotations

from .communication import NO_PAYOFF_SHARE, CandidateAdvice, Communication

__all__ = ["CANDIDATE_COLUMNS", "job_sentence", "candidate_rows", "advice_notes", "wire_ratio", "NOT_MEASURED",
           "NOT_ADVISED"]

CANDIDATE_COLUMNS = ("candidate", "error (median)", "error (worst)", "on the wire", "overflow", "wins back (estimate)")

NOT_MEASURED = ("not measured: no span carries tensorplay.step.exposed_communication_ms (spans of a tensorplay "
                "before the step timeline, or no iteration after each rank's first)")
NOT_ADVISED = ("compression advice: no iteration was advised; traced(hook, advise_every=N) or TENSORPLAY_ADVISE_EVERY=N "
               "advises steps N-1, 2N-1, ... (the default, 250: none before step 249); tensorplay demo --advise-every N")


def job_sentence(figures: Communication, which: str = "") -> str:
    """What communication costs the job's step, in one sentence; ``which`` names the model (`` (model 1)``)."""
    job = figures.job
    if job is None:
        return f"communication{which}: {NOT_MEASURED}"
    exposed = f"{job.exposed_ms:.1f} ms"
    waited_for = ", the one the others wait for" if len(figures.ranks) > 1 else ""
    hidden = ("no collective was in flight" if job.hidden_share is None
              else f"the backward hides {100 * job.hidden_share:.0f} % of it")
    payoff = (f"a compression hook can win back at most {exposed} per step" if figures.pays else
              f"under {100 * NO_PAYOFF_SHARE:.0f} % of the step: no compression will pay "
              f"(it could win back at most {exposed} per step)")
    return (f"communication{which}: {exposed} of every {job.step_ms:.1f} ms step is exposed "
            f"({100 * job.exposed_share:.0f} %), on rank {job.rank}{waited_for}; {hidden}; {payoff}")


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _row(candidate: CandidateAdvice, figures: Communication) -> tuple[str, ...]:
    overflow = (str(candidate.nonfinite) if not candidate.overflowed
                else f"{candidate.nonfinite} ({candidate.overflowed} of {figures.advised})")
    gain = candidate.win_back_ms
    step_ms = figures.job.step_ms if figures.job is not None else 0.0
    share = f" ({100 * gain / step_ms:.0f} % of the step)" if gain is not None and step_ms > 0 else ""
    return (candidate.candidate, _error(candidate.error), _error(candidate.worst_error), wire_ratio(candidate.wire_ratio),
            overflow, "-" if gain is None else f"{gain:.1f} ms{share}")


def wire_ratio(ratio: float) -> str:
    """A wire ratio as the table writes it: x0.50, and three decimals below 0.1 (PowerSGD's x0.012)."""
    return f"x{ratio:.2f}" if ratio >= 0.1 else f"x{ratio:.3f}"


def candidate_rows(figures: Communication) -> list[tuple[str, ...]]:
    """One row of cells per candidate, in the order of :data:`CANDIDATE_COLUMNS`; none without advice."""
    return [_row(candidate, figures) for candidate in figures.candidates]


def _steps(steps: tuple[int, ...]) -> str:
    shown = [str(step) for step in steps] if len(steps) <= 4 else [str(steps[0]), str(steps[1]), "...", str(steps[-1])]
    return ", ".join(shown)


def advice_notes(figures: Communication) -> list[str]:
    """What the candidates' columns mean and the estimate's model; or how to get advice."""
    if not figures.candidates:
        return [NOT_ADVISED]
    running = "" if figures.wire_ratio is None else f" (the running hook sent {wire_ratio(figures.wire_ratio)})"
    notes = [f"compression advice: {figures.advised} advised iterations of {figures.advised_ranks} "
             f"rank{'s' if figures.advised_ranks != 1 else ''} (steps {_steps(figures.advised_steps)}): what each "
             "candidate would have made of the gradients DDP handed over;  error: ||x - x^|| / ||x|| pooled over an "
             "iteration's buckets, median and worst over the advised iterations;  on the wire: bytes it would send per "
             f"byte handed over{running};  overflow: the most elements one advised iteration would make non-finite "
             "(fp16 overflow), and in how many"]
    job = figures.job
    if job is None or figures.wire_ratio is None:
        notes.append("wins back: not estimated, the exposed communication was not measured")
    else:
        notes.append(f"wins back: an estimate, if the exposed communication scales with the bytes on the wire: "
                     f"{job.exposed_ms:.1f} ms x (1 - on the wire / {figures.wire_ratio:.2f}), between 0 and the "
                     f"{job.exposed_ms:.1f} ms exposed; it leaves out the latency a collective has whatever its size, "
                     "the time compressing takes, and PowerSGD's extra collectives")
    return notes
