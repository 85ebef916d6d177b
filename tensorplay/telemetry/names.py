"""Every span attribute and metric name tensorplay emits, as fixed by the telemetry contract."""

__all__ = [
    "TRACER_NAME",
    "HOOK_SPAN_NAME",
    "JOIN_SPAN_NAME",
    "ADVICE_SPAN_NAME",
    "OPTIMIZER_STEP_SPAN_NAME",
    "Attr",
    "Metric",
    "Candidate",
]

TRACER_NAME = "tensorplay"
HOOK_SPAN_NAME = "tensorplay.comm_hook"
JOIN_SPAN_NAME = "tensorplay.join"
ADVICE_SPAN_NAME = "tensorplay.advice"
OPTIMIZER_STEP_SPAN_NAME = "tensorplay.optimizer_step"


class Attr:
    """Span attribute names."""

    HOOK = "tensorplay.hook"
    RANK = "tensorplay.rank"
    WORLD_SIZE = "tensorplay.world_size"
    STEP = "tensorplay.step"
    BUCKET_INDEX = "tensorplay.bucket.index"
    BUCKET_NUMEL = "tensorplay.bucket.numel"
    BUCKET_BYTES = "tensorplay.bucket.bytes"
    BUCKET_WIRE_BYTES = "tensorplay.bucket.wire_bytes"
    BUCKET_DTYPE = "tensorplay.bucket.dtype"
    COMPRESSION_DTYPE = "tensorplay.compression.dtype"
    COMPRESSION_RELATIVE_ERROR = "tensorplay.compression.relative_error"
    COMPRESSION_NONFINITE = "tensorplay.compression.nonfinite"
    ALLREDUCE_LATENCY_MS = "tensorplay.allreduce.latency_ms"
    ALLREDUCE_COUNT = "tensorplay.allreduce.count"
    # Extensions documented in docs/telemetry.md.
    BUCKET_NONFINITE = "tensorplay.bucket.nonfinite"
    JOIN_SHADOW_ITERATIONS = "tensorplay.join.shadow_iterations"
    JOIN_WAIT_MS = "tensorplay.join.wait_ms"
    JOIN_LAST_JOINER = "tensorplay.join.last_joiner"
    MODEL = "tensorplay.model"
    # Extensions (docs/telemetry.md, "Replicas"): on the last hook span of each reduced iteration,
    # and on the span of an unreduced optimizer step.
    OPTIMIZER_MODEL = "tensorplay.optimizer.model"
    OPTIMIZER_STEPS = "tensorplay.optimizer.steps"
    OPTIMIZER_UNREDUCED = "tensorplay.optimizer.unreduced"
    REPLICA_FINGERPRINT = "tensorplay.replica.fingerprint"
    REPLICA_FINGERPRINT_STEP = "tensorplay.replica.fingerprint_step"
    STEP_BUSY_MS = "tensorplay.step.busy_ms"
    STEP_EXPOSED_COMMUNICATION_MS = "tensorplay.step.exposed_communication_ms"
    STEP_COMMUNICATION_MS = "tensorplay.step.communication_ms"
    ADVICE_BUCKETS = "tensorplay.advice.buckets"
    ADVICE_ERROR_RATIO = "tensorplay.advice.{candidate}.error_ratio"
    ADVICE_WIRE_RATIO = "tensorplay.advice.{candidate}.wire_ratio"
    ADVICE_NONFINITE = "tensorplay.advice.{candidate}.nonfinite"
    """The advice span's figures of one candidate: ``.format(candidate=...)``."""


class Metric:
    """Prometheus metric names (counters without the ``_total`` that prometheus_client appends)."""

    ALLREDUCE_LATENCY = "tensorplay_allreduce_latency_seconds"
    BUCKET_BYTES = "tensorplay_bucket_bytes"
    WIRE_BYTES = "tensorplay_wire_bytes"
    COMPRESSION_ERROR = "tensorplay_compression_error_ratio"
    NONFINITE = "tensorplay_nonfinite_elements"
    STEP_COMPUTE = "tensorplay_step_compute_seconds"
    LAST_STEP_TIMESTAMP = "tensorplay_last_step_timestamp_seconds"
    COLLECTIVE_WAITING_SINCE = "tensorplay_collective_waiting_since_timestamp_seconds"
    JOIN_TIMESTAMP = "tensorplay_join_timestamp_seconds"
    JOIN_SHADOW_ITERATIONS = "tensorplay_join_shadow_iterations"
    JOIN_WAIT = "tensorplay_join_wait_seconds"
    JOIN_LAST_JOINER = "tensorplay_join_last_joiner"
    JOINS = "tensorplay_joins"
    TELEMETRY_ERRORS = "tensorplay_telemetry_errors"
    BUCKET_NONFINITE = "tensorplay_bucket_nonfinite_elements"
    STEP_WAIT = "tensorplay_step_wait_seconds"
    STEP_SECONDS = "tensorplay_step_seconds"
    STEPS = "tensorplay_steps"
    # The contract, section 7.
    OPTIMIZER_STEPS = "tensorplay_optimizer_steps"
    GRADIENT_REDUCTIONS = "tensorplay_gradient_reductions"
    UNREDUCED_OPTIMIZER_STEPS = "tensorplay_unreduced_optimizer_steps"
    REPLICA_FINGERPRINT = "tensorplay_replica_fingerprint"
    REPLICA_FINGERPRINT_STEP = "tensorplay_replica_fingerprint_step"
    STEP_BUSY = "tensorplay_step_busy_seconds"
    STEP_EXPOSED_COMMUNICATION = "tensorplay_step_exposed_communication_seconds"
    STEP_COMMUNICATION = "tensorplay_step_communication_seconds"
    CANDIDATE_ERROR = "tensorplay_compression_candidate_error_ratio"
    CANDIDATE_WIRE = "tensorplay_compression_candidate_wire_ratio"
    CANDIDATE_NONFINITE = "tensorplay_compression_candidate_nonfinite"


class Candidate:
    """The compressions the advice weighs: the ``candidate`` label's values (contract, section 6)."""

    FP16 = "fp16"
    BF16 = "bf16"
    POWERSGD_RANK1 = "powersgd_rank1"
    POWERSGD_RANK2 = "powersgd_rank2"
    POWERSGD_RANK4 = "powersgd_rank4"
    ALL = (FP16, BF16, POWERSGD_RANK1, POWERSGD_RANK2, POWERSGD_RANK4)
