"""``tensorplay demo``: a real multi-rank DDP job over gloo that shows tensorplay's telemetry.

One module per job: :mod:`.cli` is the `demo` subcommand (flags, checks, run), :mod:`.launch` starts the
ranks with torch's elastic launcher, :mod:`.train` is each rank's entry point (also the one to
give ``torchrun``), :mod:`.progress` shows the ranks' progress, :mod:`.report` turns their
results and spans into the final table. The demo uses tensorplay's public API like any user.
"""
