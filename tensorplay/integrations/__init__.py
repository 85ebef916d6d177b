"""tensorplay inside training frameworks: one module per framework, each imported only when asked for.

``import tensorplay`` never imports a framework; ``tensorplay.integrations.lightning`` imports
PyTorch Lightning (the ``pytorch-lightning`` package). Accelerate needs no module: its recipe is
plain tensorplay (README, "tensorplay with Lightning, Accelerate, or your own loop").
"""

__all__: list[str] = []
