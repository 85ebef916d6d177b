"""Fixtures shared by several test modules (a session-scoped fixture is shared only from here)."""

from .demo_runs import three_ranks_uneven, three_ranks_uneven_straggler, two_ranks, two_ranks_straggler  # noqa: F401
from .sink import sink  # noqa: F401
