"""Where the algorithms report what they do: a no-op unless something listens.

The algorithms (hooks, ``Join``) import this module and nothing else of ``tensorplay.telemetry``.
A hook asks :func:`current_recorder` once per call: ``None`` means nobody traces this call and
every report is skipped behind that single branch. A traced hook installs a recorder for the
synchronous part of the call; hooks that report from future callbacks keep the recorder they got
at call time. ``Join`` hands one :class:`JoinReport` per context to the join listeners, and a
:class:`JoinProgress` when a rank joins and after every round it shadows, so live gauges follow a
long skew; it only builds them when :func:`join_listening` says someone listens.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

__all__ = [
    "HookRecorder",
    "JoinReport",
    "JoinProgress",
    "current_recorder",
    "install_recorder",
    "uninstall_recorder",
    "describe_hook",
    "hook_name",
    "reports_collectives",
    "add_join_listener",
    "remove_join_listener",
    "join_listening",
    "report_join",
    "add_join_progress_listener",
    "report_join_progress",
    "enter_shadow_phase",
    "leave_shadow_phase",
    "in_shadow_phase",
    "set_collective_watch",
    "collective_started",
]

_logger = logging.getLogger(__name__)

_HOOK_NAME_ATTR = "_tensorplay_hook_name"
_REPORTS_ATTR = "_tensorplay_reports_collectives"


class HookRecorder(Protocol):
    """What a hook reports about one bucket of one iteration."""

    def collective_launching(self, tensor: torch.Tensor, watch_nonfinite: bool = False) -> Any:
        """Note that ``tensor`` is about to enter a collective; returns a token for ``collective_launched``.

        ``watch_nonfinite``: ``tensor`` is small and is this rank's own contribution, made from
        its input (PowerSGD's factors, the tensors it reduces uncompressed): the recorder notes
        whether it is finite now and whether the reduced result is, since a result that is not
        although this rank's contribution was holds another rank's non-finite elements (or an
        overflowing sum), which this rank did not make.
        """

    def collective_launched(self, token: Any, future: torch.futures.Future) -> torch.futures.Future:
        """Note the future of the collective announced by ``token``; return the future to chain on.

        That is ``future`` itself, or one that completes with its value (or failure) once the
        recorder has looked at the reduced result: the hook chains its decompression on it.
        """

    def collective_not_launched(self, token: Any, error: BaseException) -> None:
        """Note that launching the collective announced by ``token`` raised ``error``: it is not in flight."""

    def wants_compression_error(self) -> bool:
        """Whether this call samples the exact compression error (it costs a pass over the bucket)."""

    def compression_input(self, kind: str, tensor: torch.Tensor) -> None:
        """Report what a compression of ``kind`` compressed on this rank, right before the hook overwrites it.

        For a compression whose result overwrites its input and that :meth:`compression` then
        reports without a copy of the input (``original=None``: PowerSGD without error feedback,
        on a step that does not sample the error): the recorder counts its non-finite elements now.
        """

    def compression(
        self,
        kind: str,
        original: torch.Tensor | None,
        approximation: torch.Tensor | None = None,
        *,
        scale: float = 1.0,
        residual: torch.Tensor | None = None,
        recomputable: bool = False,
        carried: torch.Tensor | None = None,
        reduced: bool = False,
    ) -> None:
        """Report one compression stage.

        ``original`` is this rank's full-precision contribution. Either ``approximation * scale``
        is what compression made of it, or ``residual`` is ``original`` minus that (PowerSGD's
        error feedback). Must be called before the collective that reuses ``approximation``.

        ``reduced``: ``approximation`` is the group's result, made from every rank's compressed
        contribution (PowerSGD's decompressed bucket), so its non-finite elements may be another
        rank's: they count as made by this rank's compression only where this rank's input was
        finite and no watched collective (see :meth:`collective_launching`) brought in another
        rank's. ``original`` is None when the hook kept no copy (its input was reported with
        :meth:`compression_input`); ``carried`` is what the hook added to the bucket before
        compressing it (PowerSGD's error-feedback residual of the previous step), so that only
        the bucket's own non-finite elements count as arrived with it.

        ``recomputable`` promises that ``approximation`` is exactly ``original`` cast to its dtype
        and divided by ``scale``, that a collective reporting ``approximation`` itself (divided
        or not) reduces it, and that ``original`` stays unchanged until that collective's future
        (as returned by :meth:`collective_launched`) or else the hook's own future completes:
        the recorder may then take the figures there, off the launch path. A cast to
        ``original``'s own dtype (a float16 bucket under float16 compression) is exact and may
        be ``original`` itself, which the collective then overwrites: the recorder counts its
        non-finite elements at once, before that collective.
        """


_current: ContextVar[HookRecorder | None] = ContextVar("tensorplay_hook_recorder", default=None)


def current_recorder() -> HookRecorder | None:
    """Return the recorder of the traced hook call in progress, or ``None``."""
    return _current.get()


def install_recorder(recorder: HookRecorder) -> Token:
    """Make ``recorder`` current for the hook call about to run."""
    return _current.set(recorder)


def uninstall_recorder(token: Token) -> None:
    """Undo :func:`install_recorder`."""
    _current.reset(token)


def describe_hook(hook: Callable, name: str, reports_collectives: bool = True) -> Callable:
    """Tag ``hook`` with its display name and whether it reports every collective it launches.

    Display names compose for wrappers (``bf16_compress_wrapper(powerSGD_hook)``) while the
    function's ``__name__`` stays the one torch uses.
    """
    setattr(hook, _HOOK_NAME_ATTR, name)
    setattr(hook, _REPORTS_ATTR, reports_collectives)
    return hook


def hook_name(hook: Callable) -> str:
    """Return the display name of any hook: tensorplay's composed name, else its own name."""
    name = getattr(hook, _HOOK_NAME_ATTR, None)
    if name is not None:
        return name
    target = getattr(hook, "func", hook)  # functools.partial
    return getattr(target, "__name__", None) or type(target).__name__


def reports_collectives(hook: Callable) -> bool:
    """Whether ``hook`` reports every collective it launches (tensorplay's hooks do)."""
    return bool(getattr(hook, _REPORTS_ATTR, False))


@dataclass(frozen=True)
class JoinReport:
    """What one rank's ``Join`` context measured, handed to the join listeners once it ends."""

    rank: int
    world_size: int
    joined_unix: float
    """Unix time this rank ran out of inputs (entered ``__exit__``)."""
    all_joined_unix: float
    """Unix time this rank saw every rank joined."""
    wait_seconds: float
    """Monotonic time from this rank joining until all ranks joined."""
    shadow_iterations: int
    """Iterations this rank shadowed for the others after joining."""
    last_joiner: bool
    """Whether this rank was among the last to join (torch's ``is_last_joiner``)."""


@dataclass(frozen=True)
class JoinProgress:
    """Where one rank's ``Join`` is while it shadows: sent when it joins, then after every round."""

    rank: int
    joined_unix: float
    """Unix time this rank ran out of inputs."""
    shadow_iterations: int
    """Iterations shadowed so far in this ``Join``."""


_collective_watch: Callable[[], Callable[[], None] | None] | None = None


def set_collective_watch(watch: Callable[[], Callable[[], None] | None] | None) -> None:
    """Install what :func:`collective_started` calls (the telemetry's in-flight gauge)."""
    global _collective_watch
    _collective_watch = watch


def collective_started() -> Callable[[], None] | None:
    """Note that a blocking collective outside any hook starts (``Join``'s own all-reduce).

    Returns the function to call once it completed, or None when nobody watches. A rank that
    waits there is waiting inside a collective, not stuck outside one.
    """
    watch = _collective_watch
    if watch is None:
        return None
    try:
        return watch()
    except Exception:  # telemetry must never break training
        _logger.exception("tensorplay collective watch failed")
        return None


_join_listeners: list[Callable[[JoinReport], None]] = []
_join_progress_listeners: list[Callable[[JoinProgress], None]] = []
_shadow_depth = 0


def enter_shadow_phase() -> None:
    """Note that this rank ran out of inputs and now shadows the others' collectives.

    Hook calls made while shadowing are not this rank's own work: the traced hooks leave them
    out of ``tensorplay_step_compute_seconds``, so uneven inputs never look like a straggler.
    """
    global _shadow_depth
    _shadow_depth += 1


def leave_shadow_phase() -> None:
    """Undo :func:`enter_shadow_phase` once every rank has joined."""
    global _shadow_depth
    _shadow_depth = max(0, _shadow_depth - 1)


def in_shadow_phase() -> bool:
    """Whether this rank is shadowing inside a ``Join`` right now."""
    return _shadow_depth > 0


def add_join_listener(listener: Callable[[JoinReport], None]) -> None:
    """Have ``listener`` called with every :class:`JoinReport` from now on."""
    if listener not in _join_listeners:
        _join_listeners.append(listener)


def remove_join_listener(listener: Callable[[JoinReport], None]) -> None:
    """Stop calling ``listener``; a listener that is not registered is ignored."""
    if listener in _join_listeners:
        _join_listeners.remove(listener)


def add_join_progress_listener(listener: Callable[[JoinProgress], None]) -> None:
    """Have ``listener`` called with every :class:`JoinProgress` from now on."""
    if listener not in _join_progress_listeners:
        _join_progress_listeners.append(listener)


def report_join_progress(progress: JoinProgress) -> None:
    """Hand ``progress`` to the progress listeners; a failing one is logged and never breaks ``Join``."""
    _notify(_join_progress_listeners, progress, "join progress listener")


def join_listening() -> bool:
    """Whether any join listener is registered (``Join`` measures nothing otherwise)."""
    return bool(_join_listeners)


def report_join(report: JoinReport) -> None:
    """Hand ``report`` to every listener; a failing listener is logged and never breaks ``Join``."""
    _notify(_join_listeners, report, "join listener")


def _notify(listeners: list[Callable[[Any], None]], item: Any, kind: str) -> None:
    for listener in list(listeners):
        try:
            listener(item)
        except Exception:  # telemetry must never break training
            _logger.exception("tensorplay %s %r failed", kind, listener)
