"""tensorplay's Join on real gloo ranks: torch's semantics, torch's joinables, and its probe reports.

Rank r gets ``BASE + r * OFFSET`` inputs unless a scenario says otherwise. Every multi-rank scenario
of one world size runs in a single spawn (``ranks`` fixture); the tests read its results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import warnings
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorplay.distributed.algorithms as algorithms
from tensorplay.distributed.algorithms import join as join_module
from tensorplay.distributed.algorithms.join import Join, Joinable, JoinHook
from tensorplay.telemetry import probe

from .ranks import run_ranks
from .training import BUCKET_CAP_MB, make_model, rank_batch

BASE, OFFSET = 3, 2
OUTSIDE_JOIN = (False, False, False)  # _join_config fields: enable, throw, is_first_joinable


def uneven(world_size: int) -> list[int]:
    return [BASE + rank * OFFSET for rank in range(world_size)]


def input_patterns(world_size: int) -> dict[str, list[int]]:
    """Inputs per rank: distinct counts, several ranks tied for the most, and even inputs."""
    return {
        "uneven": uneven(world_size),
        "tied": [BASE] + [BASE + OFFSET] * (world_size - 1),
        "even": [BASE] * world_size,
    }


# --- joinables for the tests -----------------------------------------------------------------


class RecordingHook(JoinHook):
    def __init__(self, owner: "RecordingJoinable") -> None:
        self.owner = owner

    def main_hook(self) -> None:
        self.owner.main_calls += 1
        self.owner.shadowing.append(probe.in_shadow_phase())

    def post_hook(self, is_last_joiner: bool) -> None:
        self.owner.post_calls.append(is_last_joiner)


class RecordingJoinable(Joinable):
    """Records what Join does with it; launches no collective of its own."""

    def __init__(self, process_group: Any = None) -> None:
        super().__init__()
        self.process_group = process_group
        self.main_calls = 0
        self.post_calls: list[bool] = []
        self.shadowing: list[bool] = []
        self.kwargs: Optional[dict] = None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.kwargs = kwargs
        return self.hook_class(self)

    hook_class = RecordingHook

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def summary(self) -> dict:
        return {
            "main_calls": self.main_calls,
            "post_calls": self.post_calls,
            "shadowing": self.shadowing,
            "kwargs": self.kwargs,
            "config": tuple(self._join_config),
        }


class AllreduceHook(RecordingHook):
    def main_hook(self) -> None:
        super().main_hook()
        dist.all_reduce(torch.zeros(1), group=self.owner.process_group)


class AllreduceJoinable(RecordingJoinable):
    """One all-reduce of ones per input, so its sum counts the ranks that still have inputs."""

    hook_class = AllreduceHook

    def __init__(self, process_group: Any = None) -> None:
        super().__init__(process_group)
        self.active: list[int] = []

    def step(self) -> Optional[dist.Work]:
        work = Join.notify_join_context(self)
        ones = torch.ones(1)
        dist.all_reduce(ones, group=self.process_group)
        self.active.append(int(ones.item()))
        return work


# --- helpers run inside a rank ------------------------------------------------------------------


@contextlib.contextmanager
def listening() -> Iterator[list]:
    """Collect the JoinReports handed to the probe while the block runs."""
    reports: list = []
    probe.add_join_listener(reports.append)
    try:
        yield reports
    finally:
        probe.remove_join_listener(reports.append)


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def counting_allreduces() -> Iterator[list[int]]:
    """Count every dist.all_reduce this rank launches in the block: count[0]."""
    count = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    with replaced(dist, "all_reduce", counted):
        yield count


@contextlib.contextmanager
def watching_quiet_join() -> Iterator[list[str]]:
    """Have nobody listen, and record any clock read by join.py or call of probe.report_join.

    Importing tensorplay may register listeners (the metrics exporter does), so "nobody listens"
    is what ``probe.join_listening`` answers, not an empty registry.
    """
    calls: list[str] = []

    def note(name: str) -> Callable[..., float]:
        return lambda *args: calls.append(name) or 0.0

    clock = types.SimpleNamespace(time=note("time.time"), monotonic=note("time.monotonic"))
    with replaced(probe, "join_listening", lambda: False), replaced(join_module, "time", clock), replaced(
        probe, "report_join", note("report_join")
    ):
        yield calls


def train_ddp(
    rank: int,
    join_class: type,
    counts: list[int],
    zero: bool,
    recorder: Optional[RecordingJoinable] = None,
    **join_kwargs: Any,
) -> tuple[DDP, list[torch.Tensor]]:
    """Train the shared test model on ``counts[rank]`` inputs inside ``join_class``."""
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    if zero:
        optimizer: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    joinables: list = [model, optimizer] if zero else [model]
    if recorder is not None:
        recorder.process_group = model.process_group
        joinables.append(recorder)
    with join_class(joinables, **join_kwargs):
        for step in range(counts[rank]):
            optimizer.zero_grad()
            model(rank_batch(rank, step)).square().mean().backward()
            optimizer.step()
    return model, [p.detach().clone() for p in model.parameters()]


def ddp_scenarios(rank: int, world_size: int) -> dict:
    """Torch DDP (with torch SGD or ZeRO) plus a tensorplay joinable, against torch's own Join."""
    results = {}
    for name, zero in (("ddp", False), ("ddp+zero", True)):
        recorder = RecordingJoinable()
        with listening() as reports:
            model, ours = train_ddp(rank, Join, uneven(world_size), zero, recorder, divide_by_initial_world_size=False)
        _, theirs = train_ddp(rank, TorchJoin, uneven(world_size), zero, divide_by_initial_world_size=False)
        results[name] = {
            "equal": all(torch.equal(a, b) for a, b in zip(ours, theirs)),
            "model_config": tuple(model._join_config),
            "recorder": recorder.summary(),
            "reports": [dataclasses.asdict(r) for r in reports],
        }
    return results


def run_custom(rank: int, counts: list[int], process_group: Any = None, **join_kwargs: Any) -> dict:
    """Step an AllreduceJoinable (first) and a RecordingJoinable (second) ``counts[rank]`` times."""
    first, second = AllreduceJoinable(process_group), RecordingJoinable(process_group)
    first_works, second_works = [], []
    with Join([first, second], **join_kwargs):
        for _ in range(counts[rank]):
            first_works.append(isinstance(first.step(), dist.Work))
            second_works.append(Join.notify_join_context(second))
    return {
        "first": first.summary(),
        "second": second.summary(),
        "active": first.active,
        "first_notify_gives_work": all(first_works),
        "second_notify_gives_none": all(w is None for w in second_works),
        "shadow_after": probe.in_shadow_phase(),
    }


def custom_scenarios(rank: int, world_size: int) -> dict:
    """Each input pattern twice: with a listener, and with nobody listening."""
    results = {}
    for pattern, counts in input_patterns(world_size).items():
        with listening() as reports, counting_allreduces() as listened_collectives:
            run = run_custom(rank, counts, marker=pattern)
        with watching_quiet_join() as quiet_calls, counting_allreduces() as quiet_collectives:
            quiet = run_custom(rank, counts, marker=pattern)
        results[pattern] = {
            "run": run,
            "reports": [dataclasses.asdict(r) for r in reports],
            "quiet": quiet,
            "quiet_calls": quiet_calls,
            "collectives": (listened_collectives[0], quiet_collectives[0]),
        }
    return results


def subgroup_scenario(rank: int, world_size: int) -> Optional[dict]:
    """Join on the group of the last two ranks: reports carry the global rank, the group's size."""
    members = [world_size - 2, world_size - 1]
    group = dist.new_group(members)
    if rank not in members:
        return None
    counts = {members[0]: 2, members[1]: 5}
    with listening() as reports:
        run_custom(rank, [counts.get(r, 0) for r in range(world_size)], process_group=group)
    return dataclasses.asdict(reports[0])


def outcome(body: Callable[[], Any]) -> str:
    """Run ``body``; return the message of the RuntimeError it raises, or 'no error'."""
    try:
        body()
    except RuntimeError as error:
        return str(error)
    return "no error"


def throw_scenarios(rank: int, world_size: int) -> dict:
    """throw_on_early_termination=True with a tensorplay joinable, then with torch DDP + ZeRO.

    Each scenario runs under tensorplay's Join and under torch's: the messages must be the same.
    """
    joinable = AllreduceJoinable()

    def custom(join_class: type) -> None:
        with join_class([joinable], throw_on_early_termination=True):
            for _ in range(uneven(world_size)[rank]):
                joinable.step()

    def ddp(join_class: type) -> None:
        train_ddp(rank, join_class, uneven(world_size), True, throw_on_early_termination=True)

    with listening() as reports:
        custom_error, ddp_error = outcome(lambda: custom(Join)), outcome(lambda: ddp(Join))
    summary, shadow_after = joinable.summary(), probe.in_shadow_phase()
    return {
        "custom": custom_error,
        "ddp": ddp_error,
        "torch custom": outcome(lambda: custom(TorchJoin)),
        "torch ddp": outcome(lambda: ddp(TorchJoin)),
        "joinable": summary,
        "shadow_after": shadow_after,
        "reports": len(reports),
    }


def reused_join_scenario(rank: int, world_size: int) -> dict:
    """One Join entered once per epoch, as torch allows: DDP trains as under torch's reused Join."""
    params = {}
    for name, join_class in (("ours", Join), ("torch", TorchJoin)):
        model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        join = join_class([model])
        for epoch in range(3):
            with join:
                for step in range(uneven(world_size)[rank]):
                    optimizer.zero_grad()
                    model(rank_batch(rank, 10 * epoch + step)).square().mean().backward()
                    optimizer.step()
        params[name] = [p.detach().clone() for p in model.parameters()]
    return {"equal": all(torch.equal(a, b) for a, b in zip(params["ours"], params["torch"]))}


def mixed_groups_scenario(rank: int, world_size: int) -> dict:
    """Joinables on two different real process groups are refused before anything changes."""
    other = dist.new_group(list(range(world_size)))
    first, second = RecordingJoinable(dist.group.WORLD), RecordingJoinable(other)
    try:
        Join([first, second])
        error = "no error"
    except ValueError as caught:
        error = str(caught)
    return {
        "error": error,
        "configs": [tuple(first._join_config), tuple(second._join_config)],
        "hooks_made": [first.kwargs, second.kwargs],
    }


def skew_warning_scenario(rank: int, world_size: int) -> dict:
    """Rank 0 has no input, the others ``skew`` each: a warning once the skew exceeds 1000 rounds."""
    results = {}
    for skew in (1000, 1001):
        joinable = AllreduceJoinable()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Join([joinable]):
                for _ in range(skew if rank else 0):
                    joinable.step()
        results[skew] = [(str(w.message), os.path.basename(w.filename)) for w in caught]
    return results


def all_scenarios(rank: int, world_size: int) -> dict:
    return {
        "ddp": ddp_scenarios(rank, world_size),
        "custom": custom_scenarios(rank, world_size),
        "subgroup": subgroup_scenario(rank, world_size),
        "throw": throw_scenarios(rank, world_size),
        "reused": reused_join_scenario(rank, world_size),
        "mixed_groups": mixed_groups_scenario(rank, world_size),
        "skew_warning": skew_warning_scenario(rank, world_size),
    }


# --- tests on real ranks ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world_size={n}")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_ranks(all_scenarios, request.param)


def expected(counts: list[int], rank: int) -> tuple[int, bool]:
    """Return the rounds ``rank`` shadows and whether it is among the last joiners."""
    return max(counts) - counts[rank], counts[rank] == max(counts)


def check_recorder(summary: dict, shadow: int, last: bool, kwargs: dict) -> None:
    assert summary["main_calls"] == shadow
    assert summary["shadowing"] == [True] * shadow, "main hooks run inside the shadow phase"
    assert summary["post_calls"] == [last]
    assert summary["kwargs"] == kwargs
    assert summary["config"] == OUTSIDE_JOIN, "Join gives the previous config back on exit"


def check_reports(reports_by_rank: list[list[dict]], counts: list[int], world_size: int) -> None:
    """One exact report per rank, with unix times in the order the ranks really joined."""
    reports = []
    for rank, rank_reports in enumerate(reports_by_rank):
        (report,) = rank_reports
        shadow, last = expected(counts, rank)
        assert (report["rank"], report["world_size"]) == (rank, world_size)
        assert (report["shadow_iterations"], report["last_joiner"]) == (shadow, last)
        assert report["wait_seconds"] >= 0
        assert report["all_joined_unix"] == pytest.approx(report["joined_unix"] + report["wait_seconds"])
        reports.append(report)
    last_joined = max(r["joined_unix"] for r in reports)
    for report in reports:
        assert report["all_joined_unix"] >= last_joined
    for a in range(world_size):
        for b in range(world_size):
            if counts[a] < counts[b]:
                assert reports[a]["joined_unix"] < reports[b]["joined_unix"]


def test_torch_ddp_and_zero_train_exactly_as_under_torch_join(ranks: tuple[int, list[dict]]) -> None:
    world_size, results = ranks
    counts = uneven(world_size)
    for name in ("ddp", "ddp+zero"):
        for rank, result in enumerate(results):
            scenario = result["ddp"][name]
            assert scenario["equal"], f"{name}, rank {rank}: parameters differ from torch's Join"
            assert scenario["model_config"] == OUTSIDE_JOIN
            check_recorder(scenario["recorder"], *expected(counts, rank), {"divide_by_initial_world_size": False})
        check_reports([r["ddp"][name]["reports"] for r in results], counts, world_size)


@pytest.mark.parametrize("pattern", ["uneven", "tied", "even"])
def test_custom_joinables_shadow_exactly_the_missing_rounds(ranks: tuple[int, list[dict]], pattern: str) -> None:
    world_size, results = ranks
    counts = input_patterns(world_size)[pattern]
    for rank, result in enumerate(results):
        for run in (result["custom"][pattern]["run"], result["custom"][pattern]["quiet"]):
            shadow, last = expected(counts, rank)
            check_recorder(run["first"], shadow, last, {"marker": pattern})
            check_recorder(run["second"], shadow, last, {"marker": pattern})
            assert run["active"] == [sum(n > i for n in counts) for i in range(counts[rank])]
            assert run["first_notify_gives_work"] and run["second_notify_gives_none"]
            assert not run["shadow_after"]


@pytest.mark.parametrize("pattern", ["uneven", "tied", "even"])
def test_listener_receives_exact_reports(ranks: tuple[int, list[dict]], pattern: str) -> None:
    world_size, results = ranks
    counts = input_patterns(world_size)[pattern]
    check_reports([r["custom"][pattern]["reports"] for r in results], counts, world_size)


@pytest.mark.parametrize("pattern", ["uneven", "tied", "even"])
def test_nobody_listening_costs_no_report_no_clock_and_no_collective(
    ranks: tuple[int, list[dict]], pattern: str
) -> None:
    _, results = ranks
    for result in results:
        scenario = result["custom"][pattern]
        assert scenario["quiet_calls"] == []
        listened, quiet = scenario["collectives"]
        assert listened == quiet, "listening must not add collectives"


def test_reports_carry_global_rank_and_join_group_size(ranks: tuple[int, list[dict]]) -> None:
    world_size, results = ranks
    first, second = world_size - 2, world_size - 1
    assert (results[first]["subgroup"]["rank"], results[first]["subgroup"]["world_size"]) == (first, 2)
    assert (results[first]["subgroup"]["shadow_iterations"], results[first]["subgroup"]["last_joiner"]) == (3, False)
    assert (results[second]["subgroup"]["rank"], results[second]["subgroup"]["last_joiner"]) == (second, True)


def test_throw_on_early_termination_raises_on_every_rank(ranks: tuple[int, list[dict]]) -> None:
    _, results = ranks
    for rank, result in enumerate(results):
        scenario = result["throw"]
        if rank == 0:  # the rank that runs out first raises from Join.__exit__
            assert scenario["custom"] == scenario["ddp"] == "Rank 0 exhausted all inputs."
        else:  # the others from notify_join_context (ours, then torch's inside DDP's forward)
            expected = "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            assert scenario["custom"] == scenario["ddp"] == expected
        # torch's Join raises exactly the same messages on every rank.
        assert (scenario["custom"], scenario["ddp"]) == (scenario["torch custom"], scenario["torch ddp"])
        assert scenario["joinable"]["main_calls"] == 0 and scenario["joinable"]["post_calls"] == []
        assert scenario["joinable"]["config"] == OUTSIDE_JOIN
        assert not scenario["shadow_after"], "the shadow phase ends on the error path too"
        assert scenario["reports"] == 0, "no post-hooks ran, so nothing is reported"


def test_one_join_reused_across_epochs_trains_as_torch(ranks: tuple[int, list[dict]]) -> None:
    _, results = ranks
    for rank, result in enumerate(results):
        assert result["reused"]["equal"], f"rank {rank}: a Join entered once per epoch diverged from torch's"


def test_mixed_process_groups_are_refused_untouched(ranks: tuple[int, list[dict]]) -> None:
    _, results = ranks
    for result in results:
        scenario = result["mixed_groups"]
        assert scenario["error"] == "Using join context manager with multiple process groups"
        assert scenario["configs"] == [OUTSIDE_JOIN, OUTSIDE_JOIN]
        assert scenario["hooks_made"] == [None, None]


def test_warns_once_past_a_skew_of_1000(ranks: tuple[int, list[dict]]) -> None:
    _, results = ranks
    behind, *ahead = [result["skew_warning"] for result in results]
    assert behind[1000] == [] and all(r == {1000: [], 1001: []} for r in ahead)
    ((message, filename),) = behind[1001]
    assert message.startswith("Detected uneven input skew of greater than 1000. This means that rank 0 has")
    assert filename == "test_join.py", "the warning points at the user's with-block"


# --- tests without ranks -------------------------------------------------------------------------


def test_exported_from_the_algorithms_package() -> None:
    assert (algorithms.Join, algorithms.Joinable, algorithms.JoinHook) == (Join, Joinable, JoinHook)
    assert set(join_module.__all__) == {"Join", "Joinable", "JoinHook"}


def test_empty_and_non_joinable_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="^The join context manager requires at least one joinable$"):
        Join([])
    with pytest.raises(TypeError, match=r"joinables\[0\] is a object"):
        Join([object()])
    recorder = RecordingJoinable()
    with pytest.raises(TypeError, match=r"tensorplay or torch Joinable.*joinables\[1\] is a int"):
        Join([recorder, 42])
    assert recorder.kwargs is None and tuple(recorder._join_config) == OUTSIDE_JOIN


def test_mixed_process_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="^Using join context manager with multiple process groups$"):
        Join([RecordingJoinable("group a"), RecordingJoinable("group b")])


def test_disabled_join_is_vacuous() -> None:
    recorder = AllreduceJoinable()
    with listening() as reports:
        with Join([recorder], enable=False, marker=1):
            assert tuple(recorder._join_config) == (False, False, True)
            assert Join.notify_join_context(recorder) is None  # no collective: no process group exists
    assert (recorder.main_calls, recorder.post_calls, reports) == (0, [], [])
    assert tuple(recorder._join_config) == OUTSIDE_JOIN and not probe.in_shadow_phase()


def test_an_error_in_the_block_propagates_without_hooks() -> None:
    recorder = RecordingJoinable()
    with pytest.raises(KeyError):
        with Join([recorder]):
            assert tuple(recorder._join_config) == (True, False, True)
            raise KeyError("boom")
    assert (recorder.main_calls, recorder.post_calls) == (0, [])
    assert tuple(recorder._join_config) == OUTSIDE_JOIN and not probe.in_shadow_phase()


def test_only_the_first_joinable_is_marked_first() -> None:
    first, second = RecordingJoinable(), RecordingJoinable()
    join = Join([first, second], throw_on_early_termination=True)
    assert tuple(first._join_config) == (True, True, True)
    assert tuple(second._join_config) == (True, True, False)
    join.__exit__(KeyError, KeyError(), None)
    assert tuple(first._join_config) == tuple(second._join_config) == OUTSIDE_JOIN


def test_joinable_contract() -> None:
    class Incomplete(Joinable):
        def __init__(self) -> None:
            super().__init__()

    with pytest.raises(TypeError):
        Incomplete()  # type: ignore[abstract]

    class ForgotInit(RecordingJoinable):
        def __init__(self) -> None:
            pass

    with pytest.raises(AssertionError, match=r"Check that the <class '.*ForgotInit'> constructor calls the ``Joinable``"):
        Join.notify_join_context(ForgotInit())
    hook = JoinHook()
    assert hook.main_hook() is None and hook.post_hook(True) is None
