"""Is every gradient reduced, once, and are the replicas still equal? On real gloo ranks.

Every scenario runs in one spawn of two ranks (the ``outcomes`` fixture), one after the other, each
with a traced hook reporting to a sink of its own (tests/sink.py: its metrics and an in-memory
span exporter). The replicas are fingerprinted every 2 optimizer steps (``TENSORPLAY_FINGERPRINT_EVERY``).
A scenario's outcome is its counters as served, and what its spans carry (docs/telemetry.md,
"Replicas"): the optimizer step count on the last hook span of each reduced iteration, with a
fingerprint taken since that model's previous one, and the span of each unreduced step. A
scenario's models are freed before the next one, so no fingerprint covers another scenario's
model. Fingerprint steps are numbered per process: each scenario numbers an even count of them,
and the tests read them from the number before the scenario's first step (its ``base``).
"""


import contextlib
import gc
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay.distributed.algorithms.join import Join
from tensorplay.telemetry import flush
from tensorplay.telemetry import replica_sync
from tensorplay.telemetry.names import HOOK_SPAN_NAME, OPTIMIZER_STEP_SPAN_NAME, Attr, Metric

from .ranks import run_ranks
from .sink import MemorySink, memory_sink
from .training import BUCKET_CAP_MB, make_model, rank_batch

WORLD_SIZE = 2
EVERY = 2  # TENSORPLAY_FINGERPRINT_EVERY in the ranks
STEPS = 4
MICRO_BATCHES = 3


def _loss(model: nn.Module, rank: int, index: int) -> torch.Tensor:
    return model(rank_batch(rank, index)).square().mean()


def _ddp(hook: Callable, sink: MemorySink, seed: int = 0) -> DDP:
    model = DDP(make_model(seed), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(None, sink.traced(hook))
    return model


def _plain_training(rank: int, hook: Callable, optimizer: Callable[[nn.Module], Any] | None = None) -> dict:
    """STEPS steps of one traced model, one backward each."""
    sink = memory_sink()
    model = _ddp(hook, sink)
    stepping = optimizer(model) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        stepping.zero_grad()
        _loss(model, rank, step).backward()
        stepping.step()
    return _outcome(sink, rank)


def _outcome(sink: MemorySink, rank: int) -> dict[str, Any]:
    """What the scenario's sink holds: the counters and fingerprint pair as served, and what the spans carry.

    ``iterations``: per model, in the order they were first reduced (``tensorplay.optimizer.model``), the
    attributes of each hook span that carries an optimizer step count, by iteration; ``unreduced``: the
    attributes of each unreduced step's span.
    """
    assert flush(30)
    labels = {"rank": str(rank)}
    served = {name: sink.sample(f"{name}_total", **labels)
              for name in (Metric.OPTIMIZER_STEPS, Metric.GRADIENT_REDUCTIONS, Metric.UNREDUCED_OPTIMIZER_STEPS)}
    served["pair"] = (sink.sample(Metric.REPLICA_FINGERPRINT_STEP, **labels), sink.sample(Metric.REPLICA_FINGERPRINT, **labels))
    served["failures"] = sink.sample(f"{Metric.TELEMETRY_ERRORS}_total", reason="replica_sync", **labels)
    by_model: dict[int, list[dict]] = {}
    for span in sorted(sink.spans(), key=lambda span: span[Attr.STEP]):
        if Attr.OPTIMIZER_STEPS in span:
            by_model.setdefault(span[Attr.OPTIMIZER_MODEL], []).append(span)
    iterations = [by_model[number] for number in sorted(by_model)]
    return {"served": served, "iterations": iterations, "unreduced": sink.spans(OPTIMIZER_STEP_SPAN_NAME),
            "names": {span.name for span in sink.finished()}}


def _settled() -> None:
    """The scenario's models and optimizers are gone: none of them is in a later fingerprint."""
    gc.collect()


# -- the scenarios (each on every rank) -----------------------------------------------------------


def _accumulating(rank: int, forward_inside_no_sync: bool) -> dict:
    """STEPS steps of MICRO_BATCHES micro-batches each, all but the last inside no_sync()."""
    sink = memory_sink()
    model = _ddp(allreduce_hook, sink)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(MICRO_BATCHES):
            unsynced = contextlib.nullcontext() if micro == MICRO_BATCHES - 1 else model.no_sync()
            if forward_inside_no_sync:
                with unsynced:
                    _loss(model, rank, step * MICRO_BATCHES + micro).backward()
            else:
                loss = _loss(model, rank, step * MICRO_BATCHES + micro)
                with unsynced:
                    loss.backward()
        optimizer.step()
    return _outcome(sink, rank)


def accumulation_done_right(rank: int) -> dict:
    """no_sync() wraps the forward and the backward: one reduction per step."""
    return _accumulating(rank, forward_inside_no_sync=True)


def no_sync_around_the_backward_only(rank: int) -> dict:
    """no_sync() wraps the backward but not the forward: DDP decided at the forward, so every micro-batch reduces."""
    return _accumulating(rank, forward_inside_no_sync=False)


def no_sync_that_never_ends(rank: int) -> dict:
    """The first step is reduced; then no_sync() is entered and never left: every rank steps on its own gradients."""
    sink = memory_sink()
    model = _ddp(allreduce_hook, sink)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    never_left = model.no_sync()
    for step in range(STEPS):
        if step == 1:
            never_left.__enter__()
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
    never_left.__exit__(None, None, None)
    return _outcome(sink, rank)


def _scaled_on_rank1(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's hook that all-reduces, then averages on rank 0 but keeps the sum on rank 1."""
    divisor = dist.get_world_size() if dist.get_rank() == 0 else 1
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(divisor))


def custom_hook_reduces_differently_on_one_rank(rank: int) -> dict:
    return _plain_training(rank, _scaled_on_rank1)


def noop_hook_reduces_nothing(rank: int) -> dict:
    return _plain_training(rank, noop_hook)


def actor_and_critic_under_one_optimizer(rank: int) -> dict:
    """Two DDP models, one traced hook each, one optimizer over both: one step per iteration, two reductions."""
    sink = memory_sink()
    actor, critic = _ddp(allreduce_hook, sink, seed=1), _ddp(allreduce_hook, sink, seed=2)
    optimizer = torch.optim.SGD([*actor.parameters(), *critic.parameters()], lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        (_loss(actor, rank, step) + critic(actor(rank_batch(rank, 100 + step)).detach()).square().mean()).backward()
        optimizer.step()
    return _outcome(sink, rank)


def gan_with_two_optimizers(rank: int) -> dict:
    """A GAN: the generator's loss is backpropagated through the discriminator (which reduces too), then
    the discriminator trains on real and fake: two optimizer steps per iteration, three reductions."""
    sink = memory_sink()
    generator, discriminator = _ddp(allreduce_hook, sink, seed=3), _ddp(allreduce_hook, sink, seed=4)
    g_optimizer = torch.optim.SGD(generator.parameters(), lr=0.01)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    for step in range(STEPS):
        fake = generator(rank_batch(rank, step))
        g_optimizer.zero_grad()
        discriminator(fake).mean().backward()
        g_optimizer.step()
        d_optimizer.zero_grad()
        real = rank_batch(rank, 100 + step)
        discriminator(torch.cat([real, fake.detach()])).square().mean().backward()
        d_optimizer.step()
    return _outcome(sink, rank)


def zero_redundancy_optimizer(rank: int) -> dict:
    """ZeRO steps its local optimizer on this rank's shard, then broadcasts the shards: one step, equal replicas."""
    return _plain_training(rank, allreduce_hook, lambda model: ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1))


def grad_scaler_skips_a_step(rank: int) -> dict:
    """Step 1's loss is infinite on rank 1: its gradients, reduced, are on every rank, and the scaler skips the step there."""
    sink = memory_sink()
    model = _ddp(allreduce_hook, sink)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        loss = _loss(model, rank, step) * (float("inf") if step == 1 and rank == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return _outcome(sink, rank)


def uneven_inputs_in_join_then_even(rank: int) -> dict:
    """In Join, rank r trains 3 + 2r batches (rank 0 shadows 2 iterations and steps nothing meanwhile), then
    both train 5 more: rank 0's step numbers count its peer's steps while it shadowed, so the ranks'
    fingerprints of the same step number are of the same training step."""
    sink = memory_sink()
    model = _ddp(allreduce_hook, sink)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for step in range(3 + 2 * rank):
            optimizer.zero_grad()
            _loss(model, rank, step).backward()
            optimizer.step()
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        _loss(model, rank, 50 + step).backward()
        optimizer.step()
    return _outcome(sink, rank)


class _Gate:
    """A CUDA event's stand-in: it has not happened until the test opens it (the data it guards is real)."""

    def __init__(self) -> None:
        self.open = False

    def query(self) -> bool:
        return self.open


def fingerprint_copied_later(rank: int) -> dict:
    """The sample's copy (a device's, in effect) completes only after the step: the fingerprint is served at
    the next step, with the step it was taken after; the last one by flush()."""
    from tensorplay.telemetry import fingerprint, replica_sync

    gates: list[_Gate] = []
    real_take = replica_sync.take_sample

    def copied_later(parameters: Any, indices: Any) -> fingerprint.Sample:
        sample = real_take(parameters, indices)
        gates.append(_Gate())
        return fingerprint.Sample(sample.chunks, [gates[-1]])

    replica_sync.take_sample = copied_later
    try:
        sink = memory_sink()
        model = _ddp(allreduce_hook, sink)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        served = []
        for step in range(STEPS):
            optimizer.zero_grad()
            _loss(model, rank, step).backward()
            optimizer.step()
            served.append(sink.sample(Metric.REPLICA_FINGERPRINT_STEP, rank=str(rank)))
            if step < STEPS - 1:  # the copies of the steps so far are done by the next step ...
                for gate in gates:
                    gate.open = True
        served.append(sink.sample(Metric.REPLICA_FINGERPRINT_STEP, rank=str(rank)))  # ... not the last one's
        gates[-1].open = True
        outcome = _outcome(sink, rank)  # flush(): publishes it
    finally:
        replica_sync.take_sample = real_take
    return {**outcome, "served after each step": served}


def fingerprint_fails(rank: int) -> dict:
    """Taking the sample raises (a device error, say): training goes on, the failure is counted."""
    from tensorplay.telemetry import replica_sync

    def broken(parameters: Any, indices: Any) -> Any:
        raise RuntimeError("the sample could not be taken")

    real_take = replica_sync.take_sample
    replica_sync.take_sample = broken
    try:
        outcome = _plain_training(rank, allreduce_hook)
    finally:
        replica_sync.take_sample = real_take
    return outcome


SCENARIOS: dict[str, Callable[[int], dict]] = {
    scenario.__name__: scenario
    for scenario in (
        accumulation_done_right,
        no_sync_around_the_backward_only,
        no_sync_that_never_ends,
        custom_hook_reduces_differently_on_one_rank,
        noop_hook_reduces_nothing,
        actor_and_critic_under_one_optimizer,
        gan_with_two_optimizers,
        zero_redundancy_optimizer,
        grad_scaler_skips_a_step,
        uneven_inputs_in_join_then_even,
        fingerprint_copied_later,
        fingerprint_fails,
    )
}


def _every_scenario(rank: int, world_size: int) -> dict[str, dict]:
    os.environ["TENSORPLAY_FINGERPRINT_EVERY"] = str(EVERY)  # read when the first hook is traced
    outcomes = {}
    for name, scenario in SCENARIOS.items():
        base = replica_sync._watch.numbering  # the fingerprints' step number before the scenario's first step
        outcomes[name] = dict(scenario(rank), base=base)
        _settled()
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict]]:
    """``{scenario: [rank 0's outcome, rank 1's]}``."""
    by_rank = run_ranks(_every_scenario, WORLD_SIZE, timeout=300)
    return {name: [by_rank[rank][name] for rank in range(WORLD_SIZE)] for name in SCENARIOS}


# -- reading the outcomes ---------------------------------------------------------------------------


def _counters(outcome: dict) -> tuple[float, float, float]:
    served = outcome["served"]
    return (served[Metric.OPTIMIZER_STEPS], served[Metric.GRADIENT_REDUCTIONS], served[Metric.UNREDUCED_OPTIMIZER_STEPS])


def _counts(outcome: dict, model: int = 0) -> list[int]:
    """The model's optimizer steps before each of its reduced iterations, as its last hook spans say."""
    return [span[Attr.OPTIMIZER_STEPS] for span in outcome["iterations"][model]]


def _carried(outcome: dict) -> dict[int, int]:
    """``{fingerprint step (from the scenario's first step): fingerprint}`` of those the spans carried, checked:
    an integer below 2^53, each carried once per model, the same on every span that carries it."""
    carried: dict[int, int] = {}
    spans = [span for spans in outcome["iterations"] for span in spans] + outcome["unreduced"]
    for span in spans:
        if Attr.REPLICA_FINGERPRINT in span:
            step, value = span[Attr.REPLICA_FINGERPRINT_STEP] - outcome["base"], span[Attr.REPLICA_FINGERPRINT]
            assert 0 <= value < 2**53 and carried.setdefault(step, value) == value, spans
    for model_spans in outcome["iterations"]:
        steps = [span[Attr.REPLICA_FINGERPRINT_STEP] for span in model_spans if Attr.REPLICA_FINGERPRINT in span]
        assert len(steps) == len(set(steps)), model_spans
    return carried


def _served(outcome: dict) -> tuple[int, int] | None:
    """The fingerprint gauges' pair, its step from the scenario's first step; None if none was served."""
    step, value = outcome["served"]["pair"]
    return None if step is None else (int(step) - outcome["base"], int(value))


def _agreement(outcomes: list[dict]) -> dict[int, bool]:
    """``{fingerprint step both ranks' spans carried: whether their fingerprints are equal}``; the ranks'
    last fingerprints, served by the gauges, are compared too."""
    assert len({outcome["base"] for outcome in outcomes}) == 1  # the ranks' numbers agree before the scenario
    first, second = ({**_carried(outcome), **dict([_served(outcome)])} for outcome in outcomes)
    common = sorted(set(first) & set(second))
    assert common, (first, second)
    return {step: first[step] == second[step] for step in common}


# -- the tests --------------------------------------------------------------------------------------


def test_accumulation_done_right_reduces_once_per_step_and_the_replicas_stay_equal(outcomes) -> None:
    for rank, outcome in enumerate(outcomes["accumulation_done_right"]):
        assert _counters(outcome) == (STEPS, STEPS, 0), rank
        assert _counts(outcome) == list(range(STEPS))  # one reduced iteration before each step
        assert outcome["names"] == {HOOK_SPAN_NAME}  # one span per hook call, nothing else
        assert {(span[Attr.RANK], span[Attr.MODEL]) for span in outcome["iterations"][0]} == {(rank, 0)}
        # Taken after steps 2 and 4: step 2's carried by the next iteration, step 4's served.
        assert sorted(_carried(outcome)) == [2] and _served(outcome)[0] == STEPS
    assert _agreement(outcomes["accumulation_done_right"]) == {2: True, 4: True}


def test_no_sync_around_the_backward_only_reduces_every_micro_batch(outcomes) -> None:
    for outcome in outcomes["no_sync_around_the_backward_only"]:
        assert _counters(outcome) == (STEPS, STEPS * MICRO_BATCHES, 0)
        assert _counts(outcome) == [step for step in range(STEPS) for _ in range(MICRO_BATCHES)]
        assert outcome["names"] == {HOOK_SPAN_NAME}
    assert all(_agreement(outcomes["no_sync_around_the_backward_only"]).values())  # wasteful, not wrong


def test_a_no_sync_that_never_ends_leaves_steps_unreduced_with_spans_of_their_own(outcomes) -> None:
    for rank, outcome in enumerate(outcomes["no_sync_that_never_ends"]):
        assert _counters(outcome) == (STEPS, 1, STEPS - 1)
        assert _counts(outcome) == [0]  # no hook call after the first iteration
        unreduced = outcome["unreduced"]
        assert [span[Attr.OPTIMIZER_STEPS] for span in unreduced] == list(range(2, STEPS + 1))
        # The rank's unreduced steps so far (earlier scenarios had none), each span naming its model.
        assert [span[Attr.OPTIMIZER_UNREDUCED] for span in unreduced] == list(range(1, STEPS))
        assert {(span[Attr.RANK], span[Attr.HOOK], span[Attr.MODEL]) for span in unreduced} == {(rank, "allreduce_hook", 0)}
        assert {span[Attr.OPTIMIZER_MODEL] for span in unreduced} == {outcome["iterations"][0][0][Attr.OPTIMIZER_MODEL]}
        # Each carries the latest fingerprint, taken before its span was made: step 2's at 2 and 3, step 4's at 4.
        assert [span[Attr.REPLICA_FINGERPRINT_STEP] - outcome["base"] for span in unreduced] == [2, 2, 4]
    agreement = _agreement(outcomes["no_sync_that_never_ends"])
    assert agreement == {2: False, 4: False}, agreement  # from the first fingerprint after step 1, every one


def test_a_hook_that_reduces_differently_on_one_rank_sets_the_replicas_apart(outcomes) -> None:
    for outcome in outcomes["custom_hook_reduces_differently_on_one_rank"]:
        assert _counters(outcome) == (STEPS, STEPS, 0)  # a user's hook is taken to reduce: it did
    agreement = _agreement(outcomes["custom_hook_reduces_differently_on_one_rank"])
    assert not any(agreement.values()), agreement


def test_a_model_only_noop_hook_serves_is_not_traced(outcomes) -> None:
    # A model is traced from the first call of a traced hook that reduces one of its buckets: noop_hook never does.
    for outcome in outcomes["noop_hook_reduces_nothing"]:
        assert _counters(outcome) == (None, None, None)
        assert _served(outcome) is None and outcome["iterations"] == [] and outcome["names"] == {HOOK_SPAN_NAME}


def test_one_optimizer_over_two_models_counts_a_step_and_both_reductions(outcomes) -> None:
    for outcome in outcomes["actor_and_critic_under_one_optimizer"]:
        assert _counters(outcome) == (STEPS, 2 * STEPS, 0)
        # Each model its own count, though both hooks' spans say tensorplay.model 0 (one traced hook each).
        assert _counts(outcome, model=0) == _counts(outcome, model=1) == list(range(STEPS))
    assert all(_agreement(outcomes["actor_and_critic_under_one_optimizer"]).values())


def test_a_gan_counts_each_optimizers_steps_and_the_generators_backward_through_the_discriminator(outcomes) -> None:
    for outcome in outcomes["gan_with_two_optimizers"]:
        assert _counters(outcome) == (2 * STEPS, 3 * STEPS, 0)
        # The discriminator, first reduced (the generator's backward runs through it first): reduced in
        # both backwards before each D step (G's optimizer does not update D); the generator: once per G step.
        assert _counts(outcome, model=0) == [step for step in range(STEPS) for _ in range(2)]
        assert _counts(outcome, model=1) == list(range(STEPS))
    assert all(_agreement(outcomes["gan_with_two_optimizers"]).values())


def test_zero_redundancy_optimizer_counts_one_step_after_its_broadcast(outcomes) -> None:
    for outcome in outcomes["zero_redundancy_optimizer"]:
        assert _counters(outcome) == (STEPS, STEPS, 0)  # not its local optimizer's step as well
    assert all(_agreement(outcomes["zero_redundancy_optimizer"]).values())  # taken after the shards were broadcast


def test_a_step_the_grad_scaler_skips_is_not_counted(outcomes) -> None:
    for outcome in outcomes["grad_scaler_skips_a_step"]:
        assert _counters(outcome) == (STEPS, STEPS + 1, 0)
        assert _counts(outcome) == [0, 1, 1, 2, 3]  # step 1's reduction went to step 2
    assert all(_agreement(outcomes["grad_scaler_skips_a_step"]).values())


def test_a_joined_rank_steps_nothing_and_keeps_its_fingerprint_steps_in_line(outcomes) -> None:
    first, second = outcomes["uneven_inputs_in_join_then_even"]
    assert _counters(first) == (3 + STEPS + 1, 3 + STEPS + 1, 0)  # its 2 shadowed iterations: no step, no reduction
    assert _counters(second) == (5 + STEPS + 1, 5 + STEPS + 1, 0)
    assert _counts(first) == list(range(3 + STEPS + 1)) and _counts(second) == list(range(5 + STEPS + 1))
    # Rank 0 numbers its steps 1, 2, 3, then 6 ... 10 (rank 1's 4 and 5 were taken while it shadowed).
    assert sorted({**_carried(first), **dict([_served(first)])}) == [2, 6, 8, 10]
    agreement = _agreement(outcomes["uneven_inputs_in_join_then_even"])
    assert agreement == {2: True, 6: True, 8: True, 10: True}, agreement


def test_a_fingerprint_whose_copy_is_not_done_is_served_at_the_next_step_and_by_flush(outcomes) -> None:
    for outcome in outcomes["fingerprint_copied_later"]:
        # Taken after steps 2 and 4; each served once its copy was done: at the next step, and by flush().
        base = outcome["base"]
        served = [None if step is None else step - base for step in outcome["served after each step"]]
        assert served == [None, None, 2, 2, 2]
        assert sorted(_carried(outcome)) == [2]  # by the iteration after step 3, once it was served
        assert _served(outcome)[0] == STEPS
    assert all(_agreement(outcomes["fingerprint_copied_later"]).values())


def test_a_fingerprint_that_fails_never_stops_training_and_is_counted(outcomes) -> None:
    for outcome in outcomes["fingerprint_fails"]:
        assert outcome["served"]["failures"] == STEPS // EVERY  # the two fingerprinted steps
        assert outcome["served"]["pair"] == (None, None) and _carried(outcome) == {}
        assert _counters(outcome) == (STEPS, STEPS, 0)  # counted before the fingerprint was taken
        assert _counts(outcome) == list(range(STEPS))
