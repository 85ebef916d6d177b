"""Distributed training algorithms: DDP communication hooks and the generic ``Join``."""
