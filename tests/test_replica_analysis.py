"""tensorplay.analysis.replicas on optimizer step spans as the reader holds them: what the sentences say."""

import numpy as np

from tensorplay.analysis.replicas import replica_sync
from tensorplay.analysis.span_reader import OptimizerSteps


def _steps(rows: list[tuple[int, int, int, bool, int]]) -> OptimizerSteps:
    """(rank, step, reductions, unreduced, fingerprint or -1) per span."""
    table = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return OptimizerSteps(table[:, 0], table[:, 1], table[:, 2], table[:, 3].astype(bool), table[:, 4])


def test_a_rank_holding_its_own_fingerprint_is_named_from_the_first_step_it_differs() -> None:
    rows = [(rank, step, 1, False, (100 + step + (rank == 2 and step >= 20)) if step % 10 == 0 else -1)
            for rank in range(4) for step in range(1, 31)]
    sync = replica_sync(_steps(rows))
    assert sync.compared == [10, 20, 30] and sync.differing == [20, 30]
    assert (sync.divergence.step, sync.divergence.fingerprints, sync.divergence.minority) == (20, 2, [2])
    assert sync.problem
    assert sync.lines()[2].startswith("replica fingerprints: differ at 2 of the 3 steps compared, from step 20 on, where 2 "
                                      "different fingerprints were held and rank 2 holds a fingerprint fewer ranks share")


def test_reductions_that_differ_between_ranks_are_given_as_a_range_naming_the_highest() -> None:
    rows = [(0, step, 1, False, -1) for step in range(1, 5)] + [(1, step, 3, False, -1) for step in range(1, 5)]
    sync = replica_sync(_steps(rows))
    assert sync.lines()[0].startswith("gradient reductions: 1 to 3 per optimizer step across ranks (rank 1: 3): "
                                      "if these are the micro-batches of gradient accumulation, no_sync() wraps only the "
                                      "backward: wrap the forward too")
    assert sync.lines()[2] == ("replica fingerprints: none taken (every TENSORPLAY_FINGERPRINT_EVERY optimizer steps, "
                               "default 100; set it lower to compare the replicas of a short run)")
    assert not sync.problem


def test_ranks_that_never_fingerprinted_the_same_step_are_not_compared() -> None:
    rows = [(0, 5, 1, False, 7), (1, 6, 1, False, 8)]
    assert replica_sync(_steps(rows)).lines()[2] == (
        "replica fingerprints: not compared (no step was fingerprinted by two ranks)")


def test_without_optimizer_steps_one_sentence_says_so() -> None:
    assert replica_sync(_steps([])).lines() == [
        "gradient synchronisation: no optimizer step over a traced model was recorded (tensorplay counts the step() "
        "of torch.optim optimizers whose parameters a traced hook reduced)"]
