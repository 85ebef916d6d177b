"""Register a traced DDP communication hook from PyTorch Lightning, on every device.

Lightning's own switches do not do this on CPU: ``DDPStrategy(ddp_comm_hook=...)`` registers the
hook on CUDA only (elsewhere the run trains with no hook and no telemetry, silently), and with
``ddp_comm_wrapper=`` a traced hook would sit inside the wrapper and report the inner hook's
figures. :class:`TracedCommHook` registers ``traced(hook)`` itself on the model Lightning wrapped.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytorch_lightning as pl
from opentelemetry import trace
from pytorch_lightning.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from tensorplay.telemetry import TensorplayMetrics, traced
from tensorplay.telemetry.traced import Hook

__all__ = ["TracedCommHook"]


class TracedCommHook(pl.Callback):
    """
    Register ``traced(hook)`` on the DDP model of a ``Trainer`` with a DDP strategy, on any device.

    The traced hook is built in each training process when fitting starts, after Lightning
    wrapped the model in ``DistributedDataParallel``; a fresh one for every ``fit``, so each DDP
    model counts its own steps. The callback itself holds only the hook, the state (or what
    makes it) and the options, so it pickles (``DDPStrategy(start_method="spawn")``) whenever
    they do: module-level hooks, ``functools.partial`` and ``error_every`` do; a
    ``TensorplayMetrics`` or a tracer provider does not, so under spawn let each process turn
    those on (``TENSORPLAY_METRICS_PORT``, ``configure_tracing()`` in ``LightningModule.setup``).

    Arguments:
        hook: the communication hook, e.g. ``bf16_compress_hook`` or ``powerSGD_hook``.
        state: the hook's state, handed to ``register_comm_hook`` (``None``: the default
            process group).
        make_state: instead of ``state``, what builds it, called in each training process when
            fitting starts: for a state that belongs to one model and cannot cross a spawn (a
            ``PowerSGDState`` unpickles only where a process group exists), e.g.
            ``functools.partial(PowerSGDState, process_group=None, matrix_approximation_rank=1)``.
        error_every, metrics, tracer_provider: as for :func:`~tensorplay.traced`.

    Example::
        >>> # xdoctest: +SKIP
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
        ...                   callbacks=[TracedCommHook(bf16_compress_hook)])
    """

    def __init__(
        self,
        hook: Hook,
        state: Any = None,
        *,
        make_state: Optional[Callable[[], Any]] = None,
        error_every: Optional[int] = None,
        metrics: Optional[TensorplayMetrics] = None,
        tracer_provider: Optional[trace.TracerProvider] = None,
    ) -> None:
        if state is not None and make_state is not None:
            raise ValueError("TracedCommHook: give the hook's state or make_state, not both")
        self.hook = hook
        self.state = state
        self.make_state = make_state
        self.traced_options = {"error_every": error_every, "metrics": metrics, "tracer_provider": tracer_provider}
        traced(hook, **self.traced_options)  # refuse bad arguments here, where the Trainer is built

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """When fitting: refuse a strategy that is not DDP, and warn if it registers a hook of its own.

        ``validate``, ``test`` and ``predict`` run no backward pass, so no communication hook: the
        callback lets them run on any strategy, a single device included.
        """
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy):
            raise TypeError(
                f"TracedCommHook registers a DDP communication hook, but the Trainer's strategy is "
                f"{type(strategy).__name__}: use strategy='ddp' (or DDPStrategy(...)), e.g. "
                f"Trainer(devices=2, strategy='ddp')"
            )
        own = [name for name in ("ddp_comm_hook", "ddp_comm_wrapper") if getattr(strategy, f"_{name}", None) is not None]
        if own:
            warnings.warn(
                f"DDPStrategy({'=..., '.join(own)}=...) is set as well as TracedCommHook: Lightning registers "
                f"its hook on CUDA only (elsewhere it is ignored, and on CUDA DDP refuses a second hook); "
                f"pass the hook to TracedCommHook alone",
                RuntimeWarning,
                stacklevel=2,
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register a fresh ``traced(hook)`` on the ``DistributedDataParallel`` model Lightning made."""
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"TracedCommHook: the strategy's model is a {type(model).__name__}, not a "
                f"DistributedDataParallel, so it takes no communication hook"
            )
        state = self.make_state() if self.make_state is not None else self.state
        try:
            model.register_comm_hook(state, traced(self.hook, **self.traced_options))
        except RuntimeError as error:
            raise RuntimeError(
                f"TracedCommHook could not register its hook ({error}); a communication hook may be "
                f"registered already, e.g. by DDPStrategy(ddp_comm_hook=...) on CUDA"
            ) from error
