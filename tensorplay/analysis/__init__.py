"""Every figure derived from a run, once: the demo's table, ``tensorplay report`` and the tests render these.

:mod:`.span_reader` reads span files (keyed by rank, model, step, bucket); :mod:`.run` aggregates
one model's spans into arrays; :mod:`.summary` derives the per-rank figures (end waits, lateness,
latency percentiles, compute, bytes, compression, Join) and the verdict of :mod:`.straggler`, the
``TensorplayStragglerRank`` rule, which says which ranks it cannot judge (:mod:`.world`: ranks of the
job's world size the spans lack); :mod:`.communication` what communication costs the step and what
another hook would give (the compression advice), which :mod:`.communication_text` words;
:mod:`.table` words the per-rank figures as table cells; :mod:`.hang` attributes a hang as
``TensorplayRankStalled`` / ``TensorplayJobHung`` do; :mod:`.replicas` says whether every optimizer
step's gradients were reduced, once, and whether the replicas' fingerprints agreed. Nothing here
imports torch, the OpenTelemetry SDK or prometheus_client.
"""
