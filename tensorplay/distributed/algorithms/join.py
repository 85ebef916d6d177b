"""Train on inputs of uneven length across ranks: the generic join context manager, observable.

Same semantics as ``torch.distributed.algorithms.join``. One ``Join`` may hold tensorplay and torch
joinables side by side (a torch DDP model and a torch ``ZeroRedundancyOptimizer`` among them):
torch's classes call torch's own ``Join.notify_join_context`` on themselves, which reads the
``_join_config`` attribute this module sets on every joinable, in the shape torch's code expects.
``Join`` puts back each joinable's previous ``_join_config`` when it exits, so a model used after
the context (say, evaluated on one rank) no longer announces itself to a join that has ended.

Telemetry goes through :mod:`tensorplay.telemetry.probe` only. A rank that runs out of inputs is in
the probe's shadow phase until every rank has joined; only while a join listener is registered does
``Join`` read clocks and hand one :class:`~tensorplay.telemetry.probe.JoinReport` to the probe.
Either way it launches exactly the collectives torch's ``Join`` launches.
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, Callable, NamedTuple, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms import join as _torch_join

from tensorplay.telemetry import probe

__all__ = ["JoinHook", "Joinable", "Join"]

# Shadowing more rounds than this means the inputs are badly balanced: warn once per ``Join``.
_SKEW_WARNING_ROUNDS = 1000


class JoinHook:
    """
    Shadow, on a rank that ran out of inputs, what the other ranks still do each iteration.

    ``Join`` calls :meth:`main_hook` once per iteration in which some rank still has inputs, and
    :meth:`post_hook` once every rank has joined. Subclass it and override either; both default to
    doing nothing.
    """

    def main_hook(self) -> None:
        """Issue the collectives one training iteration (forward, backward, step) would issue."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """
        Finish up once every rank has joined, e.g. agree on final state across ranks.

        Arguments:
            is_last_joiner (bool): ``True`` if this rank is among those that ran out of inputs
                last (it shadowed no iteration), ``False`` otherwise.
        """


class _JoinConfig(NamedTuple):
    """What a joinable needs to know about its ``Join``; torch's DDP and ZeRO read these fields."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


_OUTSIDE_JOIN = _JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class Joinable(ABC):
    """
    Declare a class whose per-iteration collectives ``Join`` can shadow.

    A subclass implements :meth:`join_hook`, :attr:`join_device` and :attr:`join_process_group`,
    its ``__init__`` calls ``Joinable.__init__``, and it calls :meth:`Join.notify_join_context`
    on itself before the collectives of every iteration.
    """

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _OUTSIDE_JOIN

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """
        Return the :class:`JoinHook` that shadows this object's collectives.

        Arguments:
            kwargs (dict): the keyword arguments given to ``Join``; every joinable of one ``Join``
                receives the same ones, so each picks those it understands and ignores the rest.
        """

    @property
    @abstractmethod
    def join_device(self) -> torch.device:
        """Return the device of the tensors ``Join`` uses in its own collectives."""

    @property
    @abstractmethod
    def join_process_group(self) -> Any:
        """Return the process group ``Join`` runs its own collectives on."""


AnyJoinable = Union[Joinable, _torch_join.Joinable]
_JOINABLE_TYPES = (Joinable, _torch_join.Joinable)


class Join:
    """
    Keep ranks that ran out of inputs in step with those that still have some.

    On leaving the ``with`` block, a rank runs the main hooks of ``joinables`` once per iteration
    that some other rank still runs, so their collectives find a partner instead of hanging; once
    every rank is through, it runs the post-hooks. Each joinable must call
    :meth:`notify_join_context` before its collectives of every iteration.

    All joinables must share one process group; ``Join``'s own collectives run on it, with tensors
    on the first joinable's device.

    Arguments:
        joinables (List[Joinable]): tensorplay or torch joinables; their hooks run in this order.
        enable (bool): ``False`` makes the context do nothing, for inputs known to be even
            (default: ``True``).
        throw_on_early_termination (bool): raise on every rank as soon as one runs out of
            inputs, instead of shadowing (default: ``False``).
        kwargs: handed to every joinable's ``join_hook``.

    Example::
        >>> # xdoctest: +SKIP
        >>> model = DistributedDataParallel(net)
        >>> optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        >>> with Join([model, optimizer]):
        ...     for batch in my_uneven_batches:
        ...         model(batch).sum().backward()
        ...         optimizer.step()
    """

    def __init__(
        self,
        joinables: Sequence[AnyJoinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        self._joinables = _checked_joinables(joinables)
        self._process_group, self._device = _shared_group_and_device(self._joinables)
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._saved_configs = [getattr(j, "_join_config", _OUTSIDE_JOIN) for j in self._joinables]
        self._install_configs()

    def __enter__(self) -> None:
        """Arm the joinables for this context: a ``Join`` may be entered once per epoch."""
        self._install_configs()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """
        Shadow the other ranks until every rank has joined, then run the post-hooks.

        An exception raised in the block propagates untouched, without running any hook.

        Raises:
            RuntimeError: if ``throw_on_early_termination=True`` and some rank has more inputs.
        """
        try:
            if self._enable and exc_type is None:
                self._join()
        finally:
            self._restore_configs()

    @staticmethod
    def notify_join_context(joinable: AnyJoinable) -> dist.Work | None:
        """
        Tell the ``Join`` that ``joinable`` is in that this rank has not joined yet.

        Call it before the collectives of every iteration. Only the first joinable of a ``Join``
        communicates here; for the others, and outside any enabled ``Join``, this does nothing.
        With ``throw_on_early_termination=True`` it raises if some rank has already joined.

        Arguments:
            joinable (Joinable): the object about to run its collectives.

        Returns:
            The async work handle of the "not joined yet" all-reduce for the first joinable;
            ``None`` otherwise.
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise AssertionError(f"Check that the {type(joinable)} constructor calls the ``Joinable`` constructor")
        if not (config.enable and config.is_first_joinable):
            return None
        device, group = joinable.join_device, joinable.join_process_group
        work = dist.all_reduce(torch.ones(1, device=device), group=group, async_op=True)
        if config.throw_on_early_termination and _some_rank_terminated(device, group):
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return work

    def _install_configs(self) -> None:
        """Tell each joinable about this ``Join``; the first one will do the collectives."""
        for position, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(
                enable=self._enable,
                throw_on_early_termination=self._throw_on_early_termination,
                is_first_joinable=position == 0,
            )

    def _restore_configs(self) -> None:
        """Give each joinable back the config it had before this ``Join``."""
        for joinable, config in reversed(list(zip(self._joinables, self._saved_configs))):
            joinable._join_config = config

    def _join(self) -> None:
        """Shadow until every rank has joined and run the post-hooks; report only to listeners."""
        probe.enter_shadow_phase()
        if not probe.join_listening():
            self._run_post_hooks(self._shadow_until_all_joined()[1])
            return
        rank = dist.get_rank()
        joined_unix, joined = time.time(), time.monotonic()

        def shadowed(rounds: int) -> None:
            probe.report_join_progress(probe.JoinProgress(rank, joined_unix, rounds))

        shadowed(0)
        rounds, is_last_joiner = self._shadow_until_all_joined(shadowed)
        wait_seconds = time.monotonic() - joined
        self._run_post_hooks(is_last_joiner)
        probe.report_join(
            probe.JoinReport(
                rank=rank,
                world_size=dist.get_world_size(self._process_group),
                joined_unix=joined_unix,
                all_joined_unix=joined_unix + wait_seconds,
                wait_seconds=wait_seconds,
                shadow_iterations=rounds,
                last_joiner=is_last_joiner,
            )
        )

    def _shadow_until_all_joined(self, shadowed: Callable[[int], None] | None = None) -> tuple[int, bool]:
        """
        Run the main hooks once per round in which some rank still has inputs.

        ``shadowed(rounds)`` is told after every round. Returns the number of rounds and whether
        this rank was among the last to join (it ran none). The shadow phase ends here, however
        the loop ends.
        """
        rounds = 0
        try:
            while self._count_nonjoined_ranks() > 0:
                if self._throw_on_early_termination:
                    self._stop_every_rank()
                for hook in self._join_hooks:
                    hook.main_hook()
                rounds += 1
                if shadowed is not None:
                    shadowed(rounds)
                if rounds == _SKEW_WARNING_ROUNDS + 1:
                    warnings.warn(
                        f"Detected uneven input skew of greater than {_SKEW_WARNING_ROUNDS}. This means "
                        f"that rank {self._group_rank()} has at least {_SKEW_WARNING_ROUNDS} fewer inputs "
                        "than other currently-active ranks. This level of skew could lead to "
                        "performance degradation during training.",
                        stacklevel=4,  # the user's ``with`` block: _join, __exit__, caller
                    )
        finally:
            probe.leave_shadow_phase()
        return rounds, rounds == 0

    def _count_nonjoined_ranks(self) -> int:
        """Return how many ranks still have inputs: each announced itself in notify_join_context."""
        count = torch.zeros(1, device=self._device)
        completed = probe.collective_started()
        try:
            dist.all_reduce(count, group=self._process_group)
        finally:
            if completed is not None:
                completed()
        return int(count.item())

    def _stop_every_rank(self) -> None:
        """Make the ranks that still have inputs raise in notify_join_context, and raise here."""
        dist.all_reduce(torch.ones(1, device=self._device), group=self._process_group)
        raise RuntimeError(f"Rank {self._group_rank()} exhausted all inputs.")

    def _run_post_hooks(self, is_last_joiner: bool) -> None:
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    def _group_rank(self) -> int:
        return dist.get_rank(self._process_group)


def _checked_joinables(joinables: Sequence[AnyJoinable]) -> list[AnyJoinable]:
    """Return ``joinables`` as a list, or raise if it is empty or holds a non-joinable."""
    checked = list(joinables)
    if not checked:
        raise ValueError("The join context manager requires at least one joinable")
    for position, joinable in enumerate(checked):
        if not isinstance(joinable, _JOINABLE_TYPES):
            raise TypeError(
                f"Join takes tensorplay or torch Joinable objects, but joinables[{position}] "
                f"is a {type(joinable).__name__}"
            )
    return checked


def _shared_group_and_device(joinables: list[AnyJoinable]) -> tuple[Any, torch.device]:
    """Return the process group every joinable uses and the first joinable's device."""
    process_group = joinables[0].join_process_group
    if any(joinable.join_process_group != process_group for joinable in joinables[1:]):
        raise ValueError("Using join context manager with multiple process groups")
    return process_group, joinables[0].join_device


def _some_rank_terminated(device: torch.device, group: Any) -> bool:
    """Return whether a joined rank asked every rank to stop (``Join._stop_every_rank``)."""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)
    return bool(flag.item())
