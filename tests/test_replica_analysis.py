"""tensorplay.analysis.replicas on optimizer step counts as the reader holds them: what the sentences say."""

import numpy as np

from tensorplay.analysis.replicas import replica_sync
from tensorplay.analysis.span_reader import OptimizerSteps

# One row per span that carries a count: (rank, model, steps, unreduced step's span?, fingerprint step or -1,
# fingerprint or -1).
Row = tuple[int, int, int, bool, int, int]


def _steps(rows: list[Row]) -> OptimizerSteps:
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    return OptimizerSteps(table[:, 0], table[:, 1], table[:, 2], table[:, 3].astype(bool), table[:, 4], table[:, 5])


def _iterations(rank: int, counts: list[int], model: int = 0) -> list[Row]:
    """The last hook span of each reduced iteration, counting ``counts`` steps before it; no fingerprint."""
    return [(rank, model, count, False, -1, -1) for count in counts]


def test_a_rank_holding_its_own_fingerprint_is_named_from_the_first_step_it_differs() -> None:
    # Fingerprints after steps 10, 20, 30, each carried by the next iteration's span.
    rows = [(rank, 0, step, False, step if step and step % 10 == 0 else -1,
             (100 + step + (rank == 2 and step >= 20)) if step and step % 10 == 0 else -1)
            for rank in range(4) for step in range(0, 31)]
    sync = replica_sync(_steps(rows))
    assert sync.compared == [10, 20, 30] and sync.differing == [20, 30]
    assert (sync.divergence.step, sync.divergence.fingerprints, sync.divergence.minority) == (20, 2, [2])
    assert sync.problem
    assert sync.lines()[0].startswith("gradient reductions: 1 per optimizer step on every rank (30 steps each)")
    assert sync.lines()[2].startswith("replica fingerprints: differ at 2 of the 3 steps compared, from step 20 on, where 2 "
                                      "different fingerprints were held and rank 2 holds a fingerprint fewer ranks share")


def test_reductions_come_from_the_iterations_between_changes_of_the_count() -> None:
    # Rank 0 reduces once per step, rank 1 three times (no_sync() around the backward only): the
    # iterations at the last count (4) are not followed by a step the spans show.
    rows = _iterations(0, [0, 1, 2, 3, 4]) + _iterations(1, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4])
    sync = replica_sync(_steps(rows))
    assert [(rank.steps, rank.reductions, rank.unreduced) for rank in sync.ranks] == [(4, 4, 0), (4, 12, 0)]
    assert sync.lines()[0].startswith("gradient reductions: 1 to 3 per optimizer step across ranks (rank 1: 3): "
                                      "if these are the micro-batches of gradient accumulation, no_sync() wraps only the "
                                      "backward: wrap the forward too")
    assert sync.lines()[1] == "unreduced optimizer steps: none (every step followed a reduction of the models it updated)"
    assert sync.lines()[2] == ("replica fingerprints: none taken (every TENSORPLAY_FINGERPRINT_EVERY optimizer steps, "
                               "default 100; set it lower to compare the replicas of a short run)")
    assert not sync.problem


def test_a_jump_of_the_count_is_unreduced_steps_and_so_are_the_spans_after_the_last_iteration() -> None:
    # Rank 0: steps 3 and 4 had no iteration before them (the count jumped from 1 to 4). Rank 1:
    # its last iteration counted 2 steps; steps 4 to 6 have spans of their own (no hook call
    # followed them), step 3 followed the last iteration.
    rows = (_iterations(0, [0, 1, 4, 5]) + _iterations(1, [0, 1, 2])
            + [(1, 0, step, True, -1, -1) for step in (4, 5, 6)])
    sync = replica_sync(_steps(rows))
    assert [(rank.steps, rank.reductions, rank.unreduced, rank.first_unreduced) for rank in sync.ranks] == [
        (5, 3, 2, 3), (6, 3, 3, 4)]
    assert sync.problem
    assert sync.lines()[1].startswith("unreduced optimizer steps: rank 0: 2 of 5, rank 1: 3 of 6, the first at step 3: "
                                      "each such step trained its rank on its own gradients")


def test_each_model_counts_its_own_steps() -> None:
    # An actor and a critic under one optimizer: each model reduced once per step, counted per model.
    rows = _iterations(0, [0, 1, 2, 3], model=0) + _iterations(0, [0, 1, 2, 3], model=1)
    (rank,) = replica_sync(_steps(rows)).ranks
    assert (rank.steps, rank.reductions, rank.unreduced) == (6, 6, 0)


def test_ranks_that_never_fingerprinted_the_same_step_are_not_compared() -> None:
    rows = [(0, 0, 0, False, -1, -1), (0, 0, 5, False, 5, 7), (1, 0, 0, False, -1, -1), (1, 0, 6, False, 6, 8)]
    assert replica_sync(_steps(rows)).lines()[2] == (
        "replica fingerprints: not compared (no step was fingerprinted by two ranks)")


def test_without_optimizer_steps_one_sentence_says_so() -> None:
    expected = [
        "gradient synchronisation: no optimizer step over a traced model was recorded (tensorplay counts the step() "
        "of torch.optim optimizers whose parameters a traced hook reduced)"]
    assert replica_sync(_steps([])).lines() == expected
    assert replica_sync(_steps(_iterations(0, [0, 0, 0]))).lines() == expected  # reduced, never stepped
