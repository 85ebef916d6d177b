"""The Stragglers & Join dashboard: compute time and the share of every step the job waits for its
latest rank, the worst ranks, uneven inputs under Join, hangs, and the ranks picked in the per-rank
row."""

from __future__ import annotations

from .blocks import (
    Query, Row, Size, dashboard, picked_ranks_mean, rank_link, worst_over_range,
    bargauge, heatmap, stat, table, timeseries,
)

UID = "tensorplay-stragglers-join"


def build() -> dict:
    """The dashboard, rows top to bottom: whole jobs, the worst ranks, then the per-rank row."""
    return dashboard(
        UID,
        "tensorplay / Stragglers & Join",
        (
            "Whole jobs first: compute time per step across the ranks and the share of every step the job waits "
            "for its latest rank; the worst ranks (top-k, stable over the time range); uneven inputs under Join "
            "(shadowed iterations, join waits, last joiners); hangs (who waits inside a collective, who never "
            "arrived, who is gone); and a collapsed per-rank row for the ranks you pick."
        ),
        ["tensorplay", "ddp"],
        [
            Row("Job: compute time and stragglers", [
                timeseries(
                    "Compute time per step across the job (5m)",
                    (
                        "Each rank's own work per iteration (optimizer, data, forward, backward up to its first "
                        "bucket). p50 and p99: of every step of every rank of the job in the last 5 minutes. "
                        "Slowest rank: the highest mean. Compute sees a slow data loader or forward, not extra "
                        "backward between the buckets: who the job waits for is the share of every step below."
                    ),
                    [
                        Query(
                            (
                                "histogram_quantile(0.5, "
                                'job:tensorplay_step_compute_seconds_bucket:rate5m{job=~"$job"})'
                            ),
                            "p50 of all steps · {{job}}",
                        ),
                        Query(
                            (
                                "histogram_quantile(0.99, "
                                'job:tensorplay_step_compute_seconds_bucket:rate5m{job=~"$job"})'
                            ),
                            "p99 of all steps · {{job}}",
                        ),
                        Query('job:tensorplay_step_compute_seconds:max_mean5m{job=~"$job"}', "slowest rank · {{job}}"),
                    ],
                    Size(12, 8),
                    "s",
                ),
                heatmap(
                    "Compute time per step: distribution across the job (5m)",
                    (
                        "Steps per second in each compute-time bucket, all ranks of the selected jobs together. "
                        "A healthy job is one band; a straggler (or a slow node) is a thin second band above "
                        "it."
                    ),
                    Query('sum by (le) (job:tensorplay_step_compute_seconds_bucket:rate5m{job=~"$job"})', "{{le}}"),
                    Size(12, 8),
                ),
                timeseries(
                    "Highest share of every step the job waits for one rank (5m)",
                    (
                        "The latest rank's share of every step: how much of each step its peers wait for it at "
                        "the step's last collective (their end-of-step wait minus its own, docs/telemetry.md "
                        '"Lateness"), beside the job\'s threshold: what its own noise explains, k times the spread '
                        "of the other ranks' shares (at least 2 %; k grows with the number of ranks). "
                        "TensorplayStragglerRank names a rank above the threshold (and costing >= 2 ms per step) "
                        "in three disjoint 5-minute windows; critical from the red line, 20 %."
                    ),
                    [
                        Query('job:tensorplay_step_lateness:max_ratio5m{job=~"$job"}', "highest share · {{job}}"),
                        Query('job:tensorplay_step_lateness:threshold_ratio5m{job=~"$job"}', "threshold · {{job}}"),
                    ],
                    Size(12, 8),
                    "percentunit",
                    red_from=0.2,
                ),
                stat(
                    "Ranks above the job's noise (5m) and stragglers",
                    (
                        "Above the noise: ranks whose share passes the job's threshold now (and cost >= 2 ms per "
                        "step). Stragglers: those that also did 5 and 10 minutes ago, what TensorplayStragglerRank "
                        "fires on (at most 8 a job: often one slow node). Many above the noise but no straggler: "
                        "bursts that come and go."
                    ),
                    [
                        Query(
                            (
                                'sum by (job) (job_rank:tensorplay_step_lateness:outlier_ratio5m{job=~"$job"} > bool 0) '
                                'or on (job) 0 * job:tensorplay_step_lateness:threshold_ratio5m{job=~"$job"}'
                            ),
                            "above the noise · {{job}}",
                        ),
                        Query(
                            (
                                'sum by (job) (job_rank:tensorplay_step_lateness:straggler_ratio5m{job=~"$job"} > bool 0) '
                                'or on (job) 0 * job:tensorplay_step_lateness:threshold_ratio5m{job=~"$job"}'
                            ),
                            "stragglers · {{job}}",
                        ),
                    ],
                    Size(6, 8),
                ),
                stat(
                    "Ranks reporting and computing",
                    (
                        "Reporting: ranks scraped now. Computing: ranks that observed a step in the last 5 "
                        "minutes. Fewer computing than reporting: ranks that ran out of inputs (they shadow "
                        "inside Join) or are stuck."
                    ),
                    [
                        Query(
                            (
                                "count by (job) "
                                '(job_rank:tensorplay_last_step_timestamp_seconds:max{job=~"$job"})'
                            ),
                            "reporting · {{job}}",
                        ),
                        Query(
                            'count by (job) (job_rank:tensorplay_step_compute_seconds:mean5m{job=~"$job"})',
                            "computing · {{job}}",
                        ),
                    ],
                    Size(6, 8),
                ),
            ]),
            Row("Worst ranks (the $topk highest or lowest over the time range)", [
                timeseries(
                    "Straggler share of every step: highest $topk ranks (5m)",
                    (
                        "How much of every step the job waits for each rank at the step's last collective (0 = "
                        "like its peers; negative: it waits for the others). The same ranks at every point of "
                        "the time range: those whose mean share over the whole range is the highest ($topk of "
                        "them, the Worst ranks shown variable). Click a line to open that rank in the per-rank "
                        "row. The threshold is the job's noise (TensorplayStragglerRank names a rank above it in "
                        "three disjoint 5-minute windows), the red line the critical 20 %. What to do: "
                        "deploy/RUNBOOK.md, TensorplayStragglerRank."
                    ),
                    [
                        Query(
                            worst_over_range('job_rank:tensorplay_step_lateness:ratio5m{job=~"$job"}'),
                            "rank {{rank}} · {{job}}",
                        ),
                        Query('job:tensorplay_step_lateness:threshold_ratio5m{job=~"$job"}', "threshold · {{job}}"),
                    ],
                    Size(12, 8),
                    "percentunit",
                    min_zero=False,
                    red_from=0.2,
                    links=rank_link(UID),
                ),
                timeseries(
                    "Lowest mean allreduce latency: bottom $topk ranks (5m)",
                    (
                        "Mean latency per bucket over all hooks. The same ranks at every point of the time "
                        "range: those whose mean latency over the whole range is the lowest ($topk of them, the "
                        "Worst ranks shown variable). Click a line to open that rank in the per-rank row. A "
                        "straggler's own latency is the lowest of its job: the others wait for it inside the "
                        "collective, so the same ranks should top the score beside."
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
            ]),
            Row("Join: uneven inputs", [
                stat(
                    "Ranks that shadowed ≥ 10 iterations (latest Join)",
                    (
                        "How many ranks ran out of inputs at least 10 iterations before the last rank did "
                        "(TensorplayUnevenInputs' threshold): their share of the data was smaller. Even out the "
                        "shards (DistributedSampler, drop_last)."
                    ),
                    [Query(
                        (
                            'sum by (job) (max by (job, rank) (tensorplay_join_shadow_iterations{job=~"$job"}) '
                            ">= bool 10)"
                        ),
                        "{{job}}",
                    )],
                    Size(6, 4),
                ),
                stat(
                    "Last joiners (latest Join)",
                    "How many ranks were among the last to join: those with the most inputs.",
                    [Query('sum by (job) (max by (job, rank) (tensorplay_join_last_joiner{job=~"$job"}))', "{{job}}")],
                    Size(6, 4),
                ),
                stat(
                    "Join wait p50 and p99 across the job's ranks",
                    "Quantiles of the Join waits above (every rank's, every Join since the ranks started).",
                    [
                        Query(
                            (
                                "histogram_quantile(0.5, "
                                'job:tensorplay_join_wait_seconds_bucket:sum{job=~"$job"})'
                            ),
                            "p50 · {{job}}",
                        ),
                        Query(
                            (
                                "histogram_quantile(0.99, "
                                'job:tensorplay_join_wait_seconds_bucket:sum{job=~"$job"})'
                            ),
                            "p99 · {{job}}",
                        ),
                    ],
                    Size(12, 4),
                    "s",
                    decimals=2,
                ),
                bargauge(
                    "Join wait across the job's ranks (all Joins since the ranks started)",
                    (
                        "How many ranks' Join waits (time from a rank joining until every rank had joined) fell "
                        "in each bucket, over every Join since the ranks started. Most in the lowest buckets: "
                        "even inputs. A long tail: ranks that idled while others still had data."
                    ),
                    Query('sum by (le) (job:tensorplay_join_wait_seconds_bucket:sum{job=~"$job"})', "≤ {{le}} s"),
                    Size(12, 8),
                    "short",
                    fmt="heatmap",
                ),
                bargauge(
                    "Iterations shadowed in the latest Join (top $topk ranks)",
                    (
                        "The ranks that shadowed the most iterations after running out of inputs (latest Join). "
                        "TensorplayUnevenInputs fires at 10 and names the worst of them."
                    ),
                    Query(
                        'topk($topk, max by (job, rank) (tensorplay_join_shadow_iterations{job=~"$job"}))',
                        "rank {{rank}} · {{job}}",
                    ),
                    Size(12, 8),
                    "short",
                    links=rank_link(UID),
                ),
                bargauge(
                    "Longest mean Join wait (top $topk ranks)",
                    (
                        "Time from a rank joining until every rank had joined, averaged over the Joins since "
                        "the rank started: the ranks that idled longest."
                    ),
                    Query(
                        (
                            "topk($topk,\n"
                            '  sum by (job, rank) (tensorplay_join_wait_seconds_sum{job=~"$job"})\n'
                            "  /\n"
                            '  sum by (job, rank) (tensorplay_join_wait_seconds_count{job=~"$job"})\n'
                            ")"
                        ),
                        "rank {{rank}} · {{job}}",
                    ),
                    Size(12, 8),
                    "s",
                    links=rank_link(UID),
                ),
                bargauge(
                    "Ran out of inputs last (latest Join, top $topk ranks)",
                    (
                        "When the ranks joined, counted from the first rank of their job that did; the latest "
                        "are the ranks with the most inputs."
                    ),
                    Query(
                        (
                            "topk($topk, "
                            'job_rank:tensorplay_join_timestamp_seconds:since_first_join{job=~"$job"})'
                        ),
                        "rank {{rank}} · {{job}}",
                    ),
                    Size(12, 8),
                    "s",
                    links=rank_link(UID),
                ),
                stat(
                    "Join contexts completed (fewest and most among the ranks)",
                    (
                        "Join contexts the ranks have completed (e.g. one per epoch): the rank with the fewest "
                        "and the one with the most. Apart: some ranks restarted, or run another loop; the "
                        "per-rank row shows each."
                    ),
                    [
                        Query('min by (job) (tensorplay_joins_total{job=~"$job"})', "fewest · {{job}}"),
                        Query('max by (job) (tensorplay_joins_total{job=~"$job"})', "most · {{job}}"),
                    ],
                    Size(24, 4),
                ),
            ]),
            Row("Hang: who waits, who never arrived", [
                timeseries(
                    "Longest and shortest wait inside a collective, by job",
                    (
                        "How long the ranks waiting inside a traced collective have waited, by job: the longest "
                        "wait, and the shortest one among the waiting ranks. In a moving job both stay below a "
                        "step. When some ranks wait and others never arrive, the longest grows "
                        "(TensorplayRankStalled at 120 s held for 1 minute); when every rank waits, the "
                        "shortest grows too (TensorplayJobHung)."
                    ),
                    [
                        Query(
                            (
                                "time() - "
                                'job:tensorplay_collective_waiting_since_timestamp_seconds:min_waiting{job=~"$job"}'
                            ),
                            "longest · {{job}}",
                        ),
                        Query(
                            (
                                "time() - "
                                'job:tensorplay_collective_waiting_since_timestamp_seconds:max_waiting{job=~"$job"}'
                            ),
                            "shortest · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "s",
                ),
                bargauge(
                    "Seconds waiting inside a collective now (top $topk ranks)",
                    (
                        "Per rank: how long ago it launched the oldest of its traced collectives that has not "
                        "completed yet; the longest waits. A rank in no collective is not listed here (see the "
                        "table below)."
                    ),
                    Query(
                        (
                            "topk($topk, time() - "
                            '(job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{job=~"$job"} > '
                            "0))"
                        ),
                        "rank {{rank}} · {{job}}",
                    ),
                    Size(12, 8),
                    "s",
                    links=rank_link(UID),
                ),
                stat(
                    "Ranks waiting inside a collective",
                    "How many ranks of the job are inside a traced collective right now.",
                    [Query(
                        (
                            "sum by (job) "
                            '(job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{job=~"$job"} > '
                            "bool 0)"
                        ),
                        "{{job}}",
                    )],
                    Size(6, 4),
                ),
                stat(
                    "Ranks in no collective",
                    (
                        "How many ranks of the job are in no traced collective right now (computing, loading "
                        "data, or stuck outside the collective their peers wait in)."
                    ),
                    [Query(
                        (
                            "sum by (job) "
                            '(job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{job=~"$job"} '
                            "== bool 0)"
                        ),
                        "{{job}}",
                    )],
                    Size(6, 4),
                ),
                stat(
                    "Ranks TensorplayRankStalled names",
                    (
                        "Ranks the job is stuck on now: in no collective, no hook call for 120 s, while a peer "
                        "has waited in one for longer (the alert, firing). What to do: deploy/RUNBOOK.md, "
                        "TensorplayRankStalled."
                    ),
                    [Query(
                        (
                            'count by (job) (ALERTS{alertname="TensorplayRankStalled", alertstate="firing", '
                            'job=~"$job"})'
                        ),
                        "{{job}}",
                    )],
                    Size(6, 4),
                    no_value="0",
                ),
                stat(
                    "Ranks no longer scraped (last 30 min)",
                    (
                        "Ranks scraped in the last 30 minutes that can no longer be scraped: a frozen node, a "
                        "process stuck in the kernel, a crash, a deleted pod. A failed scrape lists a rank at "
                        "once, however early in the job it froze. TensorplayRankMetricsMissing fires while its "
                        "job is still scraped (more ranks scraped than missing, or the scraped ones waiting for "
                        "it in a collective), and TensorplayJobHung stays silent while any rank is listed here."
                    ),
                    [Query(
                        (
                            "count by (job) "
                            '(job_rank:tensorplay_last_step_timestamp_seconds:missing30m{job=~"$job"})'
                        ),
                        "{{job}}",
                    )],
                    Size(6, 4),
                    no_value="0",
                ),
                table(
                    "Ranks in no collective, longest since their latest hook call (top $topk)",
                    (
                        "Ranks that are in no traced collective right now, with the seconds since their latest "
                        "hook call; the longest. In a moving job these are ranks between two collectives, a "
                        "fraction of a step ago. When the job is stuck, the rank it is stuck on is at the top "
                        "with minutes: it never arrived in the collective its peers wait in."
                    ),
                    Query(
                        (
                            "topk($topk,\n"
                            '  (time() - job_rank:tensorplay_last_step_timestamp_seconds:max{job=~"$job"})\n'
                            "  and on (job, rank)\n"
                            '  (job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{job=~"$job"} == 0)\n'
                            ")"
                        ),
                    ),
                    Size(12, 8),
                    "seconds",
                    unit="s",
                    decimals=1,
                ),
                table(
                    "Ranks no longer scraped, longest gone (top $topk)",
                    (
                        "Ranks scraped in the last 30 minutes that can no longer be scraped, with the seconds "
                        "since their latest hook call (0: the rank froze before its first one). Their peers "
                        "cannot name them in the panels above: they report nothing."
                    ),
                    Query(
                        (
                            "topk($topk, time() - "
                            '(job_rank:tensorplay_last_step_timestamp_seconds:missing30m{job=~"$job"} > 0) or '
                            'job_rank:tensorplay_last_step_timestamp_seconds:missing30m{job=~"$job"} == 0)'
                        ),
                    ),
                    Size(12, 8),
                    "seconds",
                    unit="s",
                    decimals=1,
                ),
            ]),
            Row("Per-rank detail (the ranks picked in the Rank variable)", [
                timeseries(
                    "Compute time per step by rank vs the job's median",
                    (
                        "The picked ranks' own work per iteration (optimizer, data, forward, backward up to the "
                        "first bucket), and the median of every step of their job (5m). Ranks shadowing inside "
                        "Join record no compute."
                    ),
                    [
                        Query(picked_ranks_mean("tensorplay_step_compute_seconds"), "rank {{rank}}"),
                        Query(
                            (
                                "histogram_quantile(0.5, "
                                'job:tensorplay_step_compute_seconds_bucket:rate5m{job=~"$job"})'
                            ),
                            "job's median (5m) · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Share of every step the job waits for, by rank (5m)",
                    (
                        "How much of every step the picked ranks' peers wait for them at the step's last "
                        "collective (0 = like its peers). TensorplayStragglerRank fires at 20 % (and ≥ 10 ms "
                        "per step) held for 10 minutes."
                    ),
                    [Query(
                        'job_rank:tensorplay_step_lateness:ratio5m{job=~"$job", rank=~"$rank"}',
                        "rank {{rank}} · {{job}}",
                    )],
                    Size(12, 8),
                    "percentunit",
                    min_zero=False,
                    red_from=0.2,
                ),
                timeseries(
                    "Mean allreduce latency by rank",
                    (
                        "The picked ranks' mean latency per bucket over all hooks. A straggler's own latency is "
                        "the lowest of its job."
                    ),
                    [Query(picked_ranks_mean("tensorplay_allreduce_latency_seconds"), "rank {{rank}}")],
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "Steps per second by rank (own work)",
                    (
                        "Iterations with compute observed, for the picked ranks. A rank that ran out of inputs "
                        "and shadows its peers inside Join drops to 0. Steps ended: the steps whose end-of-step "
                        "wait tensorplay_step_wait_seconds_total counts (none while shadowing inside Join); 1 / "
                        "mean step time: the same steps, from their duration."
                    ),
                    [
                        Query(
                            (
                                'sum by (job, rank) (rate(tensorplay_step_compute_seconds_count{job=~"$job", '
                                'rank=~"$rank"}[$__rate_interval]))'
                            ),
                            "rank {{rank}}",
                        ),
                        Query(
                            (
                                'max by (job, rank) (rate(tensorplay_steps_total{job=~"$job", '
                                'rank=~"$rank"}[$__rate_interval]))'
                            ),
                            "rank {{rank}} · steps ended",
                        ),
                        Query(
                            '1 / job_rank:tensorplay_step_seconds:mean5m{job=~"$job", rank=~"$rank"}',
                            "rank {{rank}} · 1 / mean step time (5m)",
                        ),
                    ],
                    Size(12, 8),
                    "short",
                ),
                timeseries(
                    "Join contexts completed by rank",
                    "Join contexts the picked ranks have completed (e.g. one per epoch).",
                    [Query('sum by (job, rank) (tensorplay_joins_total{job=~"$job", rank=~"$rank"})', "rank {{rank}}")],
                    Size(12, 8),
                    "short",
                ),
                bargauge(
                    "Join wait by rank, mean over all Joins",
                    (
                        "Time from a picked rank joining until all ranks had joined, averaged over the Joins "
                        "since it started."
                    ),
                    Query(
                        (
                            'sum by (job, rank) (tensorplay_join_wait_seconds_sum{job=~"$job", rank=~"$rank"})\n'
                            "/\n"
                            'sum by (job, rank) (tensorplay_join_wait_seconds_count{job=~"$job", rank=~"$rank"})'
                        ),
                        "rank {{rank}} · {{job}}",
                    ),
                    Size(12, 8),
                    "s",
                ),
                timeseries(
                    "End-of-step wait by rank vs its peers' median (5m)",
                    (
                        "The fraction of their stepping time the picked ranks waited in each step's last "
                        "collective for the last of their peers to arrive, and the job's peers' median (the "
                        "median without the rank that waits least). A rank well below its peers arrives last: "
                        "the difference is its share of every step."
                    ),
                    [
                        Query(
                            'job_rank:tensorplay_step_wait_seconds:ratio5m{job=~"$job", rank=~"$rank"}',
                            "rank {{rank}} · {{job}}",
                        ),
                        Query(
                            'job:tensorplay_step_wait_seconds:peers_median_ratio5m{job=~"$job"}',
                            "peers' median · {{job}}",
                        ),
                    ],
                    Size(12, 8),
                    "percentunit",
                ),
            ], collapsed=True),
        ],
    )
