"""The Communication dashboard: DDP gradient communication, job first (with the gradient
synchronisation row: reductions per optimizer step, unreduced steps, replica fingerprints), then
the worst ranks, telemetry errors and the ranks picked in the per-rank row."""

from __future__ import annotations

from .blocks import (
    Query, Row, Size, dashboard, picked_ranks_mean, rank_link, worst_over_range,
    bargauge, heatmap, stat, table, timeseries,
)

UID = "tensorplay-communication"


def build() -> dict:
    """The dashboard, rows top to bottom: whole jobs, the worst ranks, then the per-rank row."""
    return dashboard(
        UID,
        "tensorplay / Communication",
        (
            "DDP gradient communication of whole jobs first: allreduce latency quantiles and distribution per "
            "hook, bytes handed over vs on the wire, compression ratio and error, non-finite elements, exposed "
            "communication and what a candidate compression could win back of it; whether every gradient is "
            "reduced once per optimizer step and the replicas stay equal; then the "
            "worst ranks (top-k, stable over the time range), telemetry errors, and a collapsed per-rank row "
            "for the ranks you pick (exemplars link to traces there)."
        ),
        ["tensorplay", "ddp"],
        [
            Row("Job: latency, bytes and compression, all ranks together", [
                timeseries(
                    "Allreduce latency p50 and p99 by hook (job, 5m)",
                    (
                        "Latency of one bucket's communication (launch of the hook's first collective to "
                        "completion of its last) over every rank of the job, per hook, in the last 5 minutes "
                        "(recorded by the tensorplay.dashboards rules). p99 far above p50: some buckets or "
                        "ranks are slow; the Worst ranks row names them. A straggler makes every other rank "
                        "wait inside the collective, which raises this too: compare with the Stragglers & Join "
                        "dashboard. Exemplars (links to traces) are on the per-rank row."
                    ),
                    [
                        Query(
                            (
                                'job_hook_quantile:tensorplay_allreduce_latency_seconds:quantile5m{job=~"$job", '
                                'quantile="0.5"}'
                            ),
                            "p50 · {{hook}} · {{job}}",
                        ),
                        Query(
                            (
                                'job_hook_quantile:tensorplay_allreduce_latency_seconds:quantile5m{job=~"$job", '
                                'quantile="0.99"}'
                            ),
                            "p99 · {{hook}} · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "s",
                ),
                heatmap(
                    "Allreduce latency distribution (job, 5m)",
                    (
                        "Buckets per second in each latency bucket, every rank and hook of the selected jobs "
                        "together, over 5 minutes. One band is a healthy job. A second band higher up is a set "
                        "of slow buckets: a slow link, or the peers of a straggler waiting for it."
                    ),
                    Query(
                        (
                            "sum by (le) "
                            '(job_hook:tensorplay_allreduce_latency_seconds_bucket:rate5m{job=~"$job"})'
                        ),
                        "{{le}}",
                    ),
                    Size(12, 8),
                ),
                timeseries(
                    "Bytes/s handed to hooks vs sent on the wire, by hook (job)",
                    (
                        "The job's ranks together, over 5 minutes. Handed over: gradient bucket bytes DDP gave "
                        "the hook. On the wire: bytes the hook sent into collectives (after compression). Per "
                        "rank: the per-rank row."
                    ),
                    [
                        Query(
                            'job_hook:tensorplay_bucket_bytes:rate5m{job=~"$job"}',
                            "handed over · {{hook}} · {{job}}",
                        ),
                        Query(
                            'job_hook:tensorplay_wire_bytes:rate5m{job=~"$job"}', "on the wire · {{hook}} · {{job}}"
                        ),
                    ],
                    Size(12, 8),
                    "Bps",
                ),
                timeseries(
                    "Compression ratio by hook (job)",
                    (
                        "How many bytes of gradient each byte on the wire carries, the job's ranks together: 1 "
                        "for allreduce_hook, about 2 for fp16/bf16, much more for PowerSGD. A drop means the "
                        "hook compresses less than it should (a wrapper fell back, a PowerSGD rank changed)."
                    ),
                    [Query(
                        (
                            'job_hook:tensorplay_bucket_bytes:rate5m{job=~"$job"}\n'
                            "/\n"
                            'job_hook:tensorplay_wire_bytes:rate5m{job=~"$job"}'
                        ),
                        "{{hook}} · {{job}}",
                    )],
                    Size(12, 8),
                    "suffix:×",
                ),
                timeseries(
                    "Exposed communication per step (job, 5m)",
                    (
                        "What communication costs each step: from the backward's last hook call to the "
                        "completion of the last hook future, on the rank the others wait for (the job's least: "
                        "every other rank adds its wait for that one). Compression or other bucket sizes can "
                        "only win back this part. docs/telemetry.md, \"Busy time and exposed communication\"."
                    ),
                    [Query(
                        'job:tensorplay_step_exposed_communication_seconds:min_mean5m{job=~"$job"}',
                        "exposed per step · {{job}}",
                    )],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Share of the step exposed, and of communication hidden (job, 5m)",
                    (
                        "On the rank the others wait for: its exposed communication over its step, and the "
                        "share of its communication (time with a collective in flight) the backward hid, "
                        "1 − exposed / communication. Hidden near 100 %: little left to win from compression."
                    ),
                    [
                        Query(
                            'job:tensorplay_step_exposed_communication:ratio5m{job=~"$job"}',
                            "exposed share of the step · {{job}}",
                        ),
                        Query(
                            'job:tensorplay_step_communication_hidden:ratio5m{job=~"$job"}',
                            "communication hidden · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "percentunit",
                ),
                timeseries(
                    "Exposed communication a candidate compression could win back per step (job, estimate)",
                    (
                        "What each candidate of the compression advice (fp16, bf16, PowerSGD at ranks 1, 2, 4: what "
                        "each would make of the ranks' own gradients, taken on one step in TENSORPLAY_ADVISE_EVERY) "
                        "could win back of the job's exposed communication per step. An estimate, on the model that "
                        "the exposed time scales with the bytes on the wire: exposed × (1 − the candidate's wire "
                        "ratio ÷ the running hook's), never below 0. It leaves out the latency a collective has "
                        "whatever its size, the time compressing takes and PowerSGD's extra collectives. Weigh it "
                        "against the candidate's error (beside). docs/telemetry.md, \"What another hook would give\"."
                    ),
                    [Query(
                        (
                            'job:tensorplay_step_exposed_communication_seconds:min_mean5m{job=~"$job"}\n'
                            "* on (job) group_right\n"
                            "clamp_min(\n"
                            "  1 - max by (job, candidate) "
                            '(tensorplay_compression_candidate_wire_ratio{job=~"$job"})\n'
                            "  * on (job) group_left "
                            'sum by (job) (job_hook:tensorplay_bucket_bytes:rate5m{job=~"$job"})\n'
                            "  / on (job) group_left "
                            'sum by (job) (job_hook:tensorplay_wire_bytes:rate5m{job=~"$job"}),\n'
                            "  0\n"
                            ")"
                        ),
                        "{{candidate}} · {{job}}",
                    )],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Candidate compressions: error at the latest advice, median and worst rank (job)",
                    (
                        "‖x − x̂‖₂ / ‖x‖₂ each candidate would make of a rank's gradients (the buckets as DDP "
                        "handed them over, pooled over the iteration's buckets) at its latest advised step: the "
                        "median over the job's ranks and the worst rank, log scale. fp16 rounds to 11 significant "
                        "bits, bf16 to 8: bf16's error is about 8 times fp16's. PowerSGD's is from scratch (no "
                        "error feedback), so higher than a warmed-up PowerSGD's. "
                        "+Inf: fp16 would overflow (see the non-finite panel)."
                    ),
                    [
                        Query(
                            'quantile by (job, candidate) (0.5, '
                            'tensorplay_compression_candidate_error_ratio{job=~"$job"})',
                            "median · {{candidate}} · {{job}}",
                        ),
                        Query(
                            'max by (job, candidate) (tensorplay_compression_candidate_error_ratio{job=~"$job"})',
                            "worst rank · {{candidate}} · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "none",
                    log_scale=True,
                ),
                bargauge(
                    "Candidate compressions: bytes on the wire per byte handed over (job)",
                    (
                        "What each candidate would send per byte DDP hands over: 0.5 for fp16 and bf16 on float32 "
                        "buckets, a few hundredths for PowerSGD. The running hook's own ratio is the inverse of the "
                        "compression ratio panel's."
                    ),
                    Query(
                        'max by (job, candidate) (tensorplay_compression_candidate_wire_ratio{job=~"$job"})',
                        "{{candidate}} · {{job}}",
                    ),
                    Size(12, 6),
                    "none",
                ),
                bargauge(
                    "Candidate compressions: elements they would make non-finite (job, latest advice)",
                    (
                        "Elements finite in the ranks' gradients that a candidate would make inf/NaN at the latest "
                        "advised step, every rank together: fp16 overflows from 65520 (before its division by "
                        "the world size); bf16 has float32's range. Above 0 for fp16: use bf16, or scale the loss."
                    ),
                    Query(
                        'sum by (job, candidate) (tensorplay_compression_candidate_nonfinite{job=~"$job"})',
                        "{{candidate}} · {{job}}",
                    ),
                    Size(12, 6),
                    "short",
                ),
                timeseries(
                    "Compression relative error p50 / p99 by hook (job, 5m)",
                    (
                        "‖x − x̂‖₂ / ‖x‖₂ of each rank's contribution, per bucket, on the steps the hook "
                        "samples, over every rank of the job. Gaps are windows without a sampled step. A p99 "
                        "far above p50: some buckets compress badly (fp16 near its range limits, a PowerSGD "
                        "rank too low for the layer)."
                    ),
                    [
                        Query(
                            (
                                "histogram_quantile(0.5, "
                                'job_hook:tensorplay_compression_error_ratio_bucket:rate5m{job=~"$job"})'
                            ),
                            "p50 · {{hook}} · {{job}}",
                        ),
                        Query(
                            (
                                "histogram_quantile(0.99, "
                                'job_hook:tensorplay_compression_error_ratio_bucket:rate5m{job=~"$job"})'
                            ),
                            "p99 · {{hook}} · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "percentunit",
                ),
                timeseries(
                    "Non-finite elements by hook (job, 5m)",
                    (
                        "Elements that were finite before compression and inf/NaN after (fp16 overflow), the "
                        "job's ranks together, in the last 5 minutes; anything above 0 raises "
                        "TensorplayGradientOverflow. NaN/inf handed over: elements already non-finite in the "
                        "buckets DDP gave compressing hooks (tensorplay_bucket_nonfinite_elements_total, an "
                        "extension): the model, not the compression."
                    ),
                    [
                        Query(
                            'job_hook:tensorplay_nonfinite_elements:increase5m{job=~"$job"}',
                            "made by compression · {{hook}} · {{job}}",
                        ),
                        Query(
                            'job_hook:tensorplay_bucket_nonfinite_elements:increase5m{job=~"$job"}',
                            "NaN/inf handed over · {{hook}} · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "short",
                ),
                stat(
                    "Ranks whose compression made non-finite elements (5m)",
                    (
                        "How many ranks of the job made at least one non-finite element in the last 5 minutes. "
                        "One or a few: those ranks' gradients (see Most non-finite elements below); all of "
                        "them: the model's scale (use bf16, or a loss scaler)."
                    ),
                    [Query(
                        (
                            "sum by (job) (\n"
                            '  sum by (job, rank) (job_rank_hook:tensorplay_nonfinite_elements:increase5m{job=~"$job"})'
                            ' > bool 0\n'
                            ")"
                        ),
                        "{{job}}",
                    )],
                    Size(12, 4),
                ),
                stat(
                    "Non-finite elements since the ranks started",
                    "Total over the job's ranks and hooks (counters restart with the processes).",
                    [Query('sum by (job) (tensorplay_nonfinite_elements_total{job=~"$job"})', "{{job}}")],
                    Size(12, 4),
                ),
            ]),
            Row("Gradient synchronisation: every gradient reduced, once; replicas equal", [
                timeseries(
                    "Gradient reductions per optimizer step (job, 5m)",
                    (
                        "DDP iterations whose gradients a traced hook reduced, per optimizer step over a traced "
                        "model, of the job's highest and lowest rank. 1: no accumulation, or no_sync() "
                        "accumulation saving what it should. K: no_sync() took no effect over K micro-batches "
                        "(it wraps only the backward: wrap the forward too). 0: steps trained on gradients that "
                        "were never reduced (TensorplayGradientsNotReduced). A second backward per step, or "
                        "several DDP models under one optimizer, count one each: no alert reads this."
                    ),
                    [
                        Query('job:tensorplay_gradient_reductions:max_per_optimizer_step5m{job=~"$job"}',
                              "highest rank · {{job}}"),
                        Query('job:tensorplay_gradient_reductions:min_per_optimizer_step5m{job=~"$job"}',
                              "lowest rank · {{job}}"),
                    ],
                    Size(12, 8),
                    "short",
                ),
                timeseries(
                    "Optimizer steps and gradient reductions per second (job)",
                    (
                        "Optimizer steps over traced DDP models and the gradient reductions of the traced hooks, "
                        "per second, the job's ranks together (iterations shadowed inside Join not counted)."
                    ),
                    [
                        Query('sum by (job) (rate(tensorplay_optimizer_steps_total{job=~"$job"}[$__rate_interval]))',
                              "optimizer steps · {{job}}"),
                        Query('sum by (job) (rate(tensorplay_gradient_reductions_total{job=~"$job"}[$__rate_interval]))',
                              "gradient reductions · {{job}}"),
                    ],
                    Size(12, 8),
                    "ops",
                ),
                timeseries(
                    "Unreduced optimizer steps (job, 5m)",
                    (
                        "Optimizer steps that updated a traced DDP model none of whose gradients were reduced "
                        "since its previous step, the job's ranks together: each trained its rank on its own "
                        "gradients. 0 is right; anything above raises TensorplayGradientsNotReduced (a no_sync() "
                        "that never ends, an accumulation off by one)."
                    ),
                    [Query('sum by (job) (job_rank:tensorplay_unreduced_optimizer_steps:increase5m{job=~"$job"})',
                           "{{job}}")],
                    Size(12, 8),
                    "short",
                    red_from=1,
                ),
                timeseries(
                    "Different replica fingerprints at one optimizer step (job, 2m)",
                    (
                        "Every TENSORPLAY_FINGERPRINT_EVERY optimizer steps each rank fingerprints its parameters; "
                        "ranks are compared only at the same step. 1: the replicas are equal. 2 or more: they "
                        "differ, and TensorplayReplicasDiverged fires once it holds for 5 minutes. No line: no "
                        "fingerprint yet (or TENSORPLAY_FINGERPRINT_EVERY=0)."
                    ),
                    [Query('max by (job) (job_step:tensorplay_replica_fingerprint:distinct2m{job=~"$job"})', "{{job}}")],
                    Size(12, 8),
                    "short",
                    red_from=2,
                ),
                stat(
                    "Latest fingerprint step, and the ranks serving one",
                    (
                        "The highest optimizer step any rank of the job fingerprinted its replica after, and how "
                        "many ranks serve a fingerprint (a rank's first comes after TENSORPLAY_FINGERPRINT_EVERY "
                        "steps)."
                    ),
                    [
                        Query('max by (job) (tensorplay_replica_fingerprint_step{job=~"$job"})', "latest step · {{job}}"),
                        Query('count by (job) (tensorplay_replica_fingerprint_step{job=~"$job"})', "ranks · {{job}}"),
                    ],
                    Size(8, 8),
                ),
                table(
                    "Ranks holding a minority fingerprint (top $topk)",
                    (
                        "Ranks whose fingerprint fewer ranks share than the most common one at the same step, "
                        "with how many ranks share it: the replicas that went their own way (none: all equal, or "
                        "split evenly with no majority -- then see the panel above)."
                    ),
                    Query('topk($topk, job_rank:tensorplay_replica_fingerprint:minority{job=~"$job"})'),
                    Size(8, 8),
                    "ranks sharing it",
                ),
                bargauge(
                    "Most unreduced optimizer steps (top $topk ranks)",
                    (
                        "The ranks that took unreduced optimizer steps in the last 5 minutes, valued by how many "
                        "since they started (none: every step was reduced). TensorplayGradientsNotReduced names "
                        "the first."
                    ),
                    Query('topk($topk, job_rank:tensorplay_unreduced_optimizer_steps:taken5m{job=~"$job"})',
                          "rank {{rank}} · {{job}}"),
                    Size(8, 8),
                    "short",
                    links=rank_link(UID),
                ),
            ]),
            Row("Worst ranks (the $topk highest or lowest over the time range)", [
                timeseries(
                    "Highest mean allreduce latency (top $topk ranks)",
                    (
                        "Mean latency per bucket over all hooks (5m). The same ranks at every point of the time "
                        "range: those whose mean latency over the whole range is the highest ($topk of them, "
                        "the Worst ranks shown variable). Click a line to open that rank in the per-rank row. A "
                        "rank far above the others sits behind a slow link or NIC; when most ranks are high and "
                        "one is low, the low one is the straggler they wait for (panel beside)."
                    ),
                    [Query(
                        worst_over_range('job_rank:tensorplay_allreduce_latency_seconds:mean5m{job=~"$job"}'),
                        "rank {{rank}} · {{job}}",
                    )],
                    Size(12, 8),
                    "s",
                    links=rank_link(UID),
                ),
                timeseries(
                    "Lowest mean allreduce latency (bottom $topk ranks)",
                    (
                        "Mean latency per bucket over all hooks (5m). The same ranks at every point of the time "
                        "range: those whose mean latency over the whole range is the lowest ($topk of them, the "
                        "Worst ranks shown variable). Click a line to open that rank in the per-rank row. A "
                        "straggler's own latency is the lowest of its job: every other rank waits for it inside "
                        "the collective. Check its compute time on the Stragglers & Join dashboard."
                    ),
                    [Query(
                        worst_over_range(
                            'job_rank:tensorplay_allreduce_latency_seconds:mean5m{job=~"$job"}', "bottomk"
                        ),
                        "rank {{rank}} · {{job}}",
                    )],
                    Size(12, 8),
                    "s",
                    links=rank_link(UID),
                ),
                bargauge(
                    "Most non-finite elements made in 5m (top $topk ranks)",
                    (
                        "The ranks whose compression made the most non-finite elements in the last 5 minutes, "
                        "over all hooks (none: nothing overflowed). TensorplayGradientOverflow names the worst "
                        "of them."
                    ),
                    Query(
                        (
                            "topk($topk,\n"
                            '  sum by (job, rank) (job_rank_hook:tensorplay_nonfinite_elements:increase5m{job=~"$job"})'
                            ' > 0\n'
                            ")"
                        ),
                        "rank {{rank}} · {{job}}",
                    ),
                    Size(24, 8),
                    "short",
                    links=rank_link(UID),
                ),
            ]),
            Row("Telemetry", [
                timeseries(
                    "Telemetry errors by reason (job)",
                    (
                        "Telemetry problems training rode over (metrics port taken, exporter down, ...), the "
                        "job's ranks together, by reason. The table beside names the ranks."
                    ),
                    [Query(
                        (
                            "sum by (job, reason) "
                            '(increase(tensorplay_telemetry_errors_total{job=~"$job"}[$__rate_interval]))'
                        ),
                        "{{reason}} · {{job}}",
                    )],
                    Size(12, 8),
                    "short",
                ),
                table(
                    "Ranks with the most telemetry errors (top $topk)",
                    (
                        "Telemetry problems each rank rode over since it started (metrics port taken, exporter "
                        "down, ...), the ranks with the most; none is the normal state. Training was not "
                        "affected, its telemetry was."
                    ),
                    Query(
                        (
                            "topk($topk, sum by (job, rank, reason) "
                            '(tensorplay_telemetry_errors_total{job=~"$job"}))'
                        ),
                    ),
                    Size(12, 8),
                    "errors",
                ),
            ]),
            Row("Per-rank detail (the ranks picked in the Rank variable)", [
                timeseries(
                    "Allreduce latency p50 by rank and hook",
                    (
                        "p50 of the time from a hook's first collective launch to its last collective's "
                        "completion, per bucket, for the picked ranks. Click an exemplar (a dot) to open that "
                        "bucket's span in Tempo."
                    ),
                    [Query(
                        (
                            "histogram_quantile(0.5, sum by (job, rank, hook, le) "
                            '(rate(tensorplay_allreduce_latency_seconds_bucket{job=~"$job", '
                            'rank=~"$rank"}[$__rate_interval])))'
                        ),
                        "rank {{rank}} · {{hook}}",
                        exemplar=True,
                    )],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Allreduce latency p99 by rank and hook",
                    (
                        "p99 of the time from a hook's first collective launch to its last collective's "
                        "completion, per bucket, for the picked ranks. Click an exemplar (a dot) to open that "
                        "bucket's span in Tempo."
                    ),
                    [Query(
                        (
                            "histogram_quantile(0.99, sum by (job, rank, hook, le) "
                            '(rate(tensorplay_allreduce_latency_seconds_bucket{job=~"$job", '
                            'rank=~"$rank"}[$__rate_interval])))'
                        ),
                        "rank {{rank}} · {{hook}}",
                        exemplar=True,
                    )],
                    Size(12, 8),
                    "s",
                ),
                heatmap(
                    "Allreduce latency distribution of the picked ranks",
                    (
                        "Buckets of tensorplay_allreduce_latency_seconds of the picked ranks; exemplars (dots) "
                        "link to the buckets' spans in Tempo."
                    ),
                    Query(
                        (
                            'sum by (le) (rate(tensorplay_allreduce_latency_seconds_bucket{job=~"$job", '
                            'rank=~"$rank"}[$__rate_interval]))'
                        ),
                        "{{le}}",
                        exemplar=True,
                    ),
                    Size(12, 8),
                ),
                timeseries(
                    "Mean allreduce latency by rank",
                    (
                        "Mean latency per bucket over all hooks, for the picked ranks. The lowest line is "
                        "usually the rank the others wait for."
                    ),
                    [Query(picked_ranks_mean("tensorplay_allreduce_latency_seconds"), "rank {{rank}}")],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Busy time, exposed communication and communication per step by rank",
                    (
                        "Per counted step of the picked ranks: busy, its own work (the previous step's last "
                        "collective done to its last hook call); exposed, the wait for communication after it "
                        "(busy + exposed is the step); communication, the time with a collective in flight."
                    ),
                    [
                        Query(_per_step("tensorplay_step_busy_seconds_total"), "busy · rank {{rank}}"),
                        Query(_per_step("tensorplay_step_exposed_communication_seconds_total"), "exposed · rank {{rank}}"),
                        Query(_per_step("tensorplay_step_communication_seconds_total"), "communication · rank {{rank}}"),
                    ],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Share of the step exposed, and of communication hidden, by rank (5m)",
                    (
                        "For the picked ranks: exposed communication over the step, and the share of communication "
                        "the backward hid (1 − exposed / communication). A rank waiting for a peer counts that wait "
                        "as exposed: the job's figure is its least rank's (the job row)."
                    ),
                    [
                        Query(
                            'job_rank:tensorplay_step_exposed_communication:ratio5m{job=~"$job", rank=~"$rank"}',
                            "exposed share · rank {{rank}}",
                        ),
                        Query(
                            'job_rank:tensorplay_step_communication_hidden:ratio5m{job=~"$job", rank=~"$rank"}',
                            "hidden · rank {{rank}}",
                        ),
                    ],
                    Size(12, 8),
                    "percentunit",
                ),
                timeseries(
                    "Candidate compression error by rank (latest advice)",
                    (
                        "What each candidate would make of the picked ranks' gradients at their latest advised step, "
                        "log scale; a rank far above its peers has gradients of another scale (or NaN/inf)."
                    ),
                    [Query(
                        'tensorplay_compression_candidate_error_ratio{job=~"$job", rank=~"$rank"}',
                        "rank {{rank}} · {{candidate}} · {{hook}}",
                    )],
                    Size(12, 8),
                    "none",
                    log_scale=True,
                ),
                timeseries(
                    "Bytes/s handed to hooks vs sent on the wire, by rank",
                    (
                        "For the picked ranks. Handed over: gradient bucket bytes DDP gave the hook. On the "
                        "wire: bytes the hook sent into collectives (after compression)."
                    ),
                    [
                        Query(
                            (
                                'sum by (job, rank, hook) (rate(tensorplay_bucket_bytes_total{job=~"$job", '
                                'rank=~"$rank"}[$__rate_interval]))'
                            ),
                            "handed over · rank {{rank}} · {{hook}}",
                        ),
                        Query(
                            (
                                'sum by (job, rank, hook) (rate(tensorplay_wire_bytes_total{job=~"$job", '
                                'rank=~"$rank"}[$__rate_interval]))'
                            ),
                            "on the wire · rank {{rank}} · {{hook}}",
                        ),
                    ],
                    Size(12, 8),
                    "Bps",
                ),
                timeseries(
                    "Compression ratio by rank",
                    "Handed over ÷ on the wire, for the picked ranks.",
                    [Query(
                        (
                            'sum by (job, rank, hook) (rate(tensorplay_bucket_bytes_total{job=~"$job", rank=~"$rank"}'
                            '[$__rate_interval]))\n'
                            "/\n"
                            'sum by (job, rank, hook) (rate(tensorplay_wire_bytes_total{job=~"$job", rank=~"$rank"}'
                            '[$__rate_interval]))'
                        ),
                        "rank {{rank}} · {{hook}}",
                    )],
                    Size(12, 8),
                    "suffix:×",
                ),
                timeseries(
                    "Mean compression error by rank and hook",
                    "Mean relative error per sampled bucket, for the picked ranks.",
                    [Query(
                        picked_ranks_mean("tensorplay_compression_error_ratio", "job, rank, hook"),
                        "rank {{rank}} · {{hook}}",
                    )],
                    Size(12, 8),
                    "percentunit",
                ),
                timeseries(
                    "Non-finite elements by rank",
                    (
                        "Elements compression made non-finite, and NaN/inf already in the buckets DDP handed "
                        "over, for the picked ranks."
                    ),
                    [
                        Query(
                            (
                                "sum by (job, rank, hook) "
                                '(increase(tensorplay_nonfinite_elements_total{job=~"$job", '
                                'rank=~"$rank"}[$__rate_interval]))'
                            ),
                            "made by compression · rank {{rank}} · {{hook}}",
                        ),
                        Query(
                            (
                                "sum by (job, rank, hook) "
                                '(increase(tensorplay_bucket_nonfinite_elements_total{job=~"$job", '
                                'rank=~"$rank"}[$__rate_interval]))'
                            ),
                            "NaN/inf handed over · rank {{rank}} · {{hook}}",
                        ),
                    ],
                    Size(12, 8),
                    "short",
                ),
            ], collapsed=True),
        ],
    )


def _per_step(counter: str) -> str:
    """Seconds of ``counter`` per counted step of each picked rank, its hooks together (as the rules)."""
    return (
        f'sum by (job, rank) (rate({counter}{{job=~"$job", rank=~"$rank"}}[$__rate_interval]))\n'
        "/\n"
        'max by (job, rank) (rate(tensorplay_steps_total{job=~"$job", rank=~"$rank"}[$__rate_interval]))'
    )
