"""Retry policy: backoff ceilings, jitter, validation, and the decision after a failure."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.domain.policy import (
    DEFAULT_BASE_DELAY_S,
    DEFAULT_CRASH_LOOP_THRESHOLD,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_DELAY_S,
    MAX_DELAY_LIMIT_S,
    Bury,
    Cancel,
    FailureFacts,
    Jitter,
    Retry,
    RetryPolicy,
    decide,
)
from flowforge.domain.reasons import RETRYABLE_REASONS, FailureReason

FAST = settings(database=None, deadline=None, max_examples=300)
R = FailureReason


def const(value: float):  # type: ignore[no-untyped-def]
    return lambda: value


def test_defaults_match_spec() -> None:
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.base_delay, policy.max_delay, policy.jitter) == (
        3,
        1.0,
        300.0,
        Jitter.FULL,
    )
    assert (DEFAULT_MAX_ATTEMPTS, DEFAULT_BASE_DELAY_S, DEFAULT_MAX_DELAY_S) == (3, 1.0, 300.0)


def test_ceiling_doubles_from_base_and_caps_at_max_delay() -> None:
    policy = RetryPolicy(base_delay=2.0, max_delay=50.0)
    assert [policy.ceiling(n) for n in range(1, 8)] == [2.0, 4.0, 8.0, 16.0, 32.0, 50.0, 50.0]


def test_ceiling_treats_zero_failures_like_the_first() -> None:
    policy = RetryPolicy(base_delay=3.0, max_delay=100.0)
    assert policy.ceiling(0) == policy.ceiling(1) == 3.0


@pytest.mark.parametrize("attempts", [63, 64, 1_000, 10**6, 10**100])
def test_ceiling_for_huge_attempt_numbers_does_not_overflow(attempts: int) -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=300.0)
    assert policy.ceiling(attempts) == 300.0
    assert policy.delay(attempts, const(0.5)) == 150.0


def test_ceiling_with_huge_base_and_attempts_stays_finite() -> None:
    policy = RetryPolicy(
        base_delay=MAX_DELAY_LIMIT_S, max_delay=MAX_DELAY_LIMIT_S, jitter=Jitter.NONE
    )
    assert policy.delay(10**9, const(0.0)) == MAX_DELAY_LIMIT_S


@pytest.mark.parametrize(("rand", "expected"), [(0.0, 0.0), (0.25, 2.0), (0.999, 7.992)])
def test_full_jitter_scales_ceiling_by_rand(rand: float, expected: float) -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=100.0, jitter=Jitter.FULL)
    assert policy.delay(4, const(rand)) == pytest.approx(expected)


@pytest.mark.parametrize(("rand", "expected"), [(0.0, 4.0), (0.5, 6.0), (0.999, 7.996)])
def test_equal_jitter_stays_in_upper_half_of_ceiling(rand: float, expected: float) -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=100.0, jitter=Jitter.EQUAL)
    assert policy.delay(4, const(rand)) == pytest.approx(expected)


@pytest.mark.parametrize("rand", [0.0, 0.3, 0.999])
def test_no_jitter_returns_ceiling_whatever_rand_says(rand: float) -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=100.0, jitter=Jitter.NONE)
    assert policy.delay(4, const(rand)) == 8.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"base_delay": -0.1},
        {"base_delay": -1.0, "max_delay": -0.5},
        {"base_delay": 10.0, "max_delay": 5.0},
    ],
)
def test_retry_policy_refuses_invalid_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_retry_policy_accepts_single_attempt_and_zero_delays() -> None:
    policy = RetryPolicy(max_attempts=1, base_delay=0.0, max_delay=0.0)
    assert policy.delay(5, const(0.9)) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_delay": math.nan},
        {"max_delay": math.nan},
        {"max_delay": math.inf},
        {"base_delay": math.inf, "max_delay": math.inf},
    ],
    ids=["nan-base", "nan-max", "inf-max", "inf-base-and-max"],
)
def test_retry_policy_refuses_non_finite_delays(kwargs: dict[str, float]) -> None:
    # BUG: every check in __post_init__ is a comparison, and comparisons with NaN are False,
    # so NaN (and inf) pass. The delay then reaches `make_interval(secs => NaN)`, which
    # PostgreSQL rejects ("interval out of range"), failing the whole routing batch.
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


POLICY = RetryPolicy(max_attempts=3, base_delay=1.0, max_delay=60.0, jitter=Jitter.NONE)


def test_decide_cancels_when_cancel_requested_whatever_the_reason() -> None:
    for reason in FailureReason:
        facts = FailureFacts(reason, attempts_used=99, crash_streak=99, cancel_requested=True)
        assert decide(POLICY, facts, const(0.5)) == Cancel()


def test_decide_buries_crash_loop_when_lease_expired_streak_reaches_threshold() -> None:
    facts = FailureFacts(R.LEASE_EXPIRED, attempts_used=1, crash_streak=3)
    assert decide(POLICY, facts, const(0.5), crash_loop_threshold=3) == Bury(R.CRASH_LOOP)


def test_decide_retries_lease_expired_below_crash_loop_threshold() -> None:
    facts = FailureFacts(R.LEASE_EXPIRED, attempts_used=1, crash_streak=2)
    assert decide(POLICY, facts, const(0.5), crash_loop_threshold=3) == Retry(1.0)


def test_decide_uses_default_crash_loop_threshold() -> None:
    streak = DEFAULT_CRASH_LOOP_THRESHOLD
    facts = FailureFacts(R.LEASE_EXPIRED, attempts_used=1, crash_streak=streak)
    assert decide(POLICY, facts, const(0.5)) == Bury(R.CRASH_LOOP)


def test_decide_ignores_crash_streak_for_other_reasons() -> None:
    facts = FailureFacts(R.HANDLER_ERROR, attempts_used=1, crash_streak=10)
    assert decide(POLICY, facts, const(0.5), crash_loop_threshold=3) == Retry(1.0)


@pytest.mark.parametrize("reason", [R.PERMANENT_ERROR, R.UNKNOWN_HANDLER, R.UNSERIALIZABLE_RESULT])
def test_decide_buries_non_retryable_reason_with_that_reason(reason: FailureReason) -> None:
    facts = FailureFacts(reason, attempts_used=1, crash_streak=0)
    assert decide(POLICY, facts, const(0.5)) == Bury(reason)


def test_retryable_reasons_are_handler_error_lease_expired_timeout_and_child_failed() -> None:
    assert {R.HANDLER_ERROR, R.LEASE_EXPIRED, R.TIMEOUT, R.CHILD_FAILED} == RETRYABLE_REASONS


@pytest.mark.parametrize("reason", sorted(RETRYABLE_REASONS))
def test_decide_buries_max_attempts_exceeded_when_budget_is_spent(reason: FailureReason) -> None:
    facts = FailureFacts(reason, attempts_used=3, crash_streak=0)
    assert decide(POLICY, facts, const(0.5)) == Bury(R.MAX_ATTEMPTS_EXCEEDED)


@pytest.mark.parametrize("reason", sorted(RETRYABLE_REASONS))
def test_decide_retries_with_policy_delay_while_budget_lasts(reason: FailureReason) -> None:
    policy = RetryPolicy(max_attempts=5, base_delay=2.0, max_delay=60.0, jitter=Jitter.FULL)
    facts = FailureFacts(reason, attempts_used=3, crash_streak=0)
    assert decide(policy, facts, const(0.5)) == Retry(policy.delay(3, const(0.5))) == Retry(4.0)


def test_decide_with_single_attempt_policy_never_retries() -> None:
    policy = RetryPolicy(max_attempts=1)
    facts = FailureFacts(R.HANDLER_ERROR, attempts_used=1, crash_streak=0)
    assert decide(policy, facts, const(0.5)) == Bury(R.MAX_ATTEMPTS_EXCEEDED)


finite = st.floats(
    min_value=0.0, max_value=MAX_DELAY_LIMIT_S, allow_nan=False, allow_infinity=False
)


@st.composite
def policies(draw: st.DrawFn) -> RetryPolicy:
    base = draw(finite)
    cap = draw(st.floats(min_value=base, max_value=MAX_DELAY_LIMIT_S))
    return RetryPolicy(
        max_attempts=draw(st.integers(1, 50)),
        base_delay=base,
        max_delay=cap,
        jitter=draw(st.sampled_from(list(Jitter))),
    )


@FAST
@given(
    policies(),
    st.integers(min_value=0, max_value=10**30),
    st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_delay_is_always_within_zero_and_max_delay(
    policy: RetryPolicy, attempts: int, rand: float
) -> None:
    delay = policy.delay(attempts, const(rand))
    ceiling = policy.ceiling(attempts)
    assert math.isfinite(delay)
    assert 0.0 <= delay <= ceiling <= policy.max_delay
    if policy.jitter is Jitter.EQUAL:
        assert delay >= ceiling / 2
    if policy.jitter is Jitter.NONE:
        assert delay == ceiling


@FAST
@given(policies(), st.integers(min_value=1, max_value=200))
def test_ceiling_never_decreases_with_more_failures(policy: RetryPolicy, attempts: int) -> None:
    assert policy.ceiling(attempts) <= policy.ceiling(attempts + 1)


@FAST
@given(
    policies(),
    st.sampled_from(list(FailureReason)),
    st.integers(0, 60),
    st.integers(0, 10),
    st.booleans(),
    st.integers(1, 10),
)
def test_decide_always_returns_a_decision_with_a_bounded_delay(
    policy: RetryPolicy,
    reason: FailureReason,
    used: int,
    streak: int,
    cancel: bool,
    threshold: int,
) -> None:
    facts = FailureFacts(reason, attempts_used=used, crash_streak=streak, cancel_requested=cancel)
    decision = decide(policy, facts, const(0.7), crash_loop_threshold=threshold)
    assert isinstance(decision, Retry | Bury | Cancel)
    if isinstance(decision, Retry):
        assert reason in RETRYABLE_REASONS and used < policy.max_attempts and not cancel
        assert 0.0 <= decision.delay <= policy.max_delay
