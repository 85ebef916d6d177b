"""Fixtures shared by several test modules (a session-scoped fixture is shared only from here)."""

from .demo_runs import (  # noqa: F401
    three_ranks_uneven,
    three_ranks_uneven_straggler,
    two_ranks,
    two_ranks_never_synced,
    two_ranks_straggler,
)
from .sink import sink  # noqa: F401
