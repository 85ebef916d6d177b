"""Distributed training algorithms: DDP communication hooks and the generic ``Join``."""

from .join import Join, Joinable, JoinHook

__all__ = ["Join", "Joinable", "JoinHook"]
