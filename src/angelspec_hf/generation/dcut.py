"""D-cut: where to cut each draft, and when not to draft at all, at batch 1 and across a batch.

Each drafted position j has a confidence ``c_j`` (the draft probability of its token), calibrated
online against observed acceptance; the survival ``s_j = prod_{i<=j} c_i`` is the expected
acceptance of position j. Keeping k positions yields ``1 + sum_{j<=k} s_j`` tokens for one
verification of k+1 tokens, whose cost comes from the profiled `CostModel`; D-cut keeps the k that
maximises tokens per second, counting the round's drafting time with its verification. Drafting
itself is timed online, and put into the profile's time by the pace of the target's forwards
(measured over predicted, see `DCutPolicy.record_forward`); when recent rounds were expected (by
their calibrated survivals) to make fewer tokens per second than plain decoding would have, the
policy stops drafting and only retries after ``explore_every`` rounds or more (see `DraftGate`),
so a speculative configuration is not slower than AR for long.
Every ``explore_every``-th kept draft is kept whole, so the calibration keeps seeing outcomes at
every depth even when the current estimate says to cut short.

The candidate generators look for ``drafter.draft_policy`` (duck-typed: ``should_draft``,
``choose``, ``observe``); drafters without one draft their fixed length.

`BatchDCutPolicy` is the same idea for `SpeculativeEngine`: the verify window is a budget shared by
all active requests, priced by the batch-aware cost model ``C(batch, window, context)``; the
window is widened only while the survivals it admits, summed over requests, raise expected tokens
per second, and a drafter's rows stop drafting when its drafting has not been paying (on a CPU
at concurrency 16 a forward is compute-bound and drafted slots are rarely worth their cost). A
closed gate reopens as soon as its last drafting step, repriced at the current batch and context,
would pay (`BatchDCutPolicy.predicted_efficiency`); each drafter of a routed batch has its own
gate and calibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..modeling_angelspec_common import alternatives_verified
from .cost_model import CostModel


@dataclass
class Calibrator:
    """Per-bin acceptance rates of raw confidences, shrunk towards the raw value while data is scarce."""

    bins: int = 10
    prior_weight: float = 4.0
    accepted: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.accepted = self.accepted or [0.0] * self.bins
        self.seen = self.seen or [0.0] * self.bins

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.bins), self.bins - 1)

    def __call__(self, confidence: float) -> float:
        confidence = probability(confidence)
        b = self._bin(confidence)
        return (self.accepted[b] + self.prior_weight * confidence) / (self.seen[b] + self.prior_weight)

    def update(self, confidence: float, was_accepted: bool) -> None:
        b = self._bin(probability(confidence))
        self.seen[b] += 1
        self.accepted[b] += float(was_accepted)


def probability(confidence: float) -> float:
    """A drafter's confidence as a probability: NaN (a drafter whose logits overflowed) counts as
    0, anything else is clamped to [0, 1], so a bad value costs a short draft, not the call."""
    return min(max(confidence, 0.0), 1.0) if confidence == confidence else 0.0


def expected_tokens(survival: list[float], k: int) -> float:
    return 1.0 + sum(survival[:k])


def survival_of(confidences: list[float]) -> list[float]:
    """``s_j = prod_{i<=j} c_i``: how often position j is reached and accepted."""
    survival, running = [], 1.0
    for confidence in confidences:
        running *= confidence
        survival.append(running)
    return survival


def alternatives_gain(kept: int, gains: list[float], max_width: int) -> tuple[float, int]:
    """What first-token alternatives verified beside a chain of ``kept`` drafts add to a round: the
    expected tokens (``gains``: each alternative's calibrated chance of being the target's token;
    a round that takes one gains it besides the target's own token) and how many join the forward."""
    count = alternatives_verified(kept, len(gains), max_width)
    return sum(gains[:count]), count


def round_rate(tokens: float, kept: int, seconds: float, verify_seconds, alternative_gains: list[float] = (),
               alternatives_width: int = 0) -> float:
    """Expected tokens per second of a batch-1 round that keeps ``kept`` drafts expected to make
    ``tokens`` (`expected_tokens`) after ``seconds`` of drafting: its verify forward checks the
    pending token, the kept drafts and the alternatives that fit beside them (`alternatives_gain`)."""
    extra, count = alternatives_gain(kept, alternative_gains, alternatives_width)
    return (tokens + extra) / (seconds + verify_seconds(kept + 1 + count))


def best_cut(confidences: list[float], verify_seconds, sunk_seconds: float = 0.0,
             alternative_gains: list[float] = (), alternatives_width: int = 0) -> int:
    """The k in 0..len(confidences) maximising ``(1 + sum_{j<=k} s_j) / (sunk + verify(k + 1))``
    (`round_rate`; the smallest such k on ties).

    ``sunk_seconds`` is what the round has already spent drafting: it no longer depends on the cut,
    but it is part of the round's time, so it still weighs in the rate (see `best_window`).

    Where the verify forward also checks first-token alternatives (batch-1 greedy ``generate``;
    ``alternative_gains``, at most ``alternatives_width`` tokens in the forward), keeping k >= 1
    drafts verifies as many of them as fit, which add their `alternatives_gain` to the expected
    tokens and their width to the forward; keeping none verifies none. Why: the alternatives are
    worth most where the chain's first token is least sure, which is where the chain alone keeps
    nothing. On the reference target (AMD EPYC, one thread) MTP-TTT3 + D-cut cut 92 of 893 rounds
    to no draft when it priced the chain alone, 16 tokens fewer accepted than the fixed length over
    the 16 benchmark prompts, where the two alternatives beside a chain rescue about 17% of rounds
    (docs/dcut.md, "First-token alternatives").
    """
    survival = survival_of(confidences)
    return max(range(len(survival) + 1), key=lambda kept: round_rate(
        expected_tokens(survival, kept), kept, sunk_seconds, verify_seconds, alternative_gains, alternatives_width))


def step_progress(survivals: list[list[float]], width: int, slowest_row: bool = False,
                  remaining: list[int] | None = None) -> float:
    """What a step of verify window ``width`` is expected to achieve, in tokens (see `best_window`).

    Summed over rows; with ``slowest_row``, the progress of the row that would take the most such
    steps to finish: ``max(remaining) * min_r min(E_r, remaining_r) / remaining_r``, which is the
    least expected tokens of any row when ``remaining`` is not given (or all equal and no row
    expects more tokens than it has left).
    """
    gains = [expected_tokens(s, width - 1) for s in survivals]
    if not slowest_row:
        return sum(gains)
    if remaining is None:
        return min(gains)
    if len(remaining) != len(gains):
        raise ValueError(f"remaining has {len(remaining)} rows but survivals {len(gains)}: give one per active row")
    left = [max(r, 1) for r in remaining]
    return max(left) * min(min(gain, r) / r for gain, r in zip(gains, left))


def best_window(survivals: list[list[float]], verify_seconds, slowest_row: bool = False,
                sunk_seconds: float = 0.0, remaining: list[int] | None = None) -> int:
    """The verify window (pending token plus drafts per row) that maximises expected tokens per
    second for a batch: ``sum_r (1 + sum_{j<w} s_rj) / (sunk + verify(w))``.

    ``sunk_seconds``, the step's drafting time, is spent whatever the width, yet it belongs to the
    step's time: leaving it out prices a step by its verification alone and favours narrow windows
    that make fewer tokens for the same drafting (measured on the reference target, engine at
    concurrency 4, DFly-Block8, 12 prompts: without it, and with the sparser cost profile that
    `ENGINE_BATCH_SIZES` replaced, D-cut chose 4 of 8 slots in 59% of steps, tau 1.76 against fixed
    windows' 2.21; with both, tau 2.08 and 3% / 10% faster than fixed windows in two runs).

    In a padded batch every row's window is as wide as the widest one, so once a width is paid
    each row keeps all its drafts up to it; only the width is chosen. Rows without drafts still
    gain their one token per forward.

    With ``slowest_row`` the sum becomes the progress of the slowest row: when no request waits for
    a slot the run lasts as long as its longest request, and tokens that rows about to finish
    anyway accept do not shorten it (see `BatchDCutPolicy`). With ``remaining`` (tokens each row
    still has to make) the slowest row is the one needing the most steps at this step's expected
    progress, not the one with the least expected tokens: a row that cannot draft well but is
    about to finish must not keep a long-running row from drafting.
    """
    longest = max((len(s) for s in survivals), default=0)

    def rate(width: int) -> float:
        return step_progress(survivals, width, slowest_row, remaining) / (sunk_seconds + verify_seconds(width))

    return max(range(1, longest + 2), key=rate)


def worth_extending(survival: list[float], verify_seconds, max_positions: int,
                    seconds_per_position: float = 0.0, alternative_gains: list[float] = (),
                    alternatives_width: int = 0) -> bool:
    """Could drafting more positions (up to ``max_positions`` in all) beat the best rate of this prefix?

    Each further position survives at most as often as the last one (``s_{j+1} <= s_j``), so m more
    positions add at most ``m * s_k`` expected tokens. Every m is tried, not only the next one,
    because verification need not cost more for more tokens (a CPU's kernels for a few rows can be
    slower than for eight), so a position that does not pay alone may pay with the ones after it.
    A round's time is its drafting (``seconds_per_position`` for each drafted position, kept or
    not) plus the verification of what it keeps, and of the first-token alternatives verified
    beside it (`alternatives_gain`; none by default).
    """
    k = len(survival)
    drafted = k * seconds_per_position
    alternatives = (alternative_gains, alternatives_width)
    best = max(round_rate(expected_tokens(survival, j), j, drafted, verify_seconds, *alternatives) for j in range(k + 1))
    last, reached = (survival[-1] if survival else 1.0), expected_tokens(survival, k)
    return any(round_rate(reached + m * last, k + m, drafted + m * seconds_per_position, verify_seconds, *alternatives) > best
               for m in range(1, max_positions - k + 1))


class FixedLengthPolicy:
    """Always keeps the full draft: the comparison point for D-cut."""

    def should_draft(self) -> bool:
        return True

    def keep_drafting(self, confidences: list[float], context: int) -> bool:
        return True

    def choose(self, confidences: list[float], context: int) -> int:
        return len(confidences)

    def observe(self, confidences: list[float], accepted: int, draft_seconds: float, context: int) -> None:
        pass


class DraftGate:
    """When to draft: stops drafting while it has not been paying and retries after
    ``explore_every`` rounds, doubling the wait after every retry that did not pay either (up to
    ``max_backoff`` times), since each retry costs a drafting round that is slower than plain decoding.

    With ``probe_budget`` the wait is also long enough that failed retries cost at most that
    fraction of the time: a retry that lost L plain steps' worth of time is followed by at least
    ``L / probe_budget`` plain steps. In a large batch one retry is a whole batch's drafting round
    (measured on a CPU at concurrency 16 with 12 rows: 0.8-1.3 plain steps lost), so a fixed wait
    of 8-16 steps would spend several percent of the run on retries that cannot pay; at batch 1 a
    retry costs a fraction of a step.
    """

    def __init__(self, explore_every: int = 8, smoothing: float = 0.2, max_backoff: int = 8,
                 probe_budget: float | None = None, close_below: float = 1.0):
        if probe_budget is not None and not 0 < probe_budget <= 1:
            raise ValueError(f"probe_budget is a fraction of the time (0 < probe_budget <= 1), got {probe_budget}")
        if not 0 < close_below <= 1:
            raise ValueError(f"close_below is an efficiency (0 < close_below <= 1), got {close_below}")
        if explore_every < 1:
            raise ValueError(f"explore_every is the plain steps before a retry (at least 1), got {explore_every}")
        self.explore_every = explore_every
        self.close_below = close_below
        self.smoothing = smoothing
        self.max_backoff = max_backoff
        self.probe_budget = probe_budget
        self.efficiency: float | None = None  # moving average of (tokens/s drafting) / (tokens/s plain)
        self.rounds = 0  # drafting rounds measured (see `record_rate`)
        self.lost_steps = 0.0  # plain steps' worth of time the last drafting round lost (0 if it paid)
        self.backoff = 1
        self.skipped = 0

    def wait(self) -> int:
        """Plain steps to take before retrying while drafting has not been paying."""
        steps = self.explore_every * self.backoff
        if self.probe_budget is not None:
            steps = max(steps, math.ceil(self.lost_steps / self.probe_budget))
        return steps

    @property
    def paying(self) -> bool:
        """Whether drafting counts as paying: not measured yet, or its efficiency at least ``close_below``."""
        return self.efficiency is None or self.efficiency >= self.close_below

    def should_draft(self) -> bool:
        if self.paying:
            return True
        self.skipped += 1
        if self.skipped >= self.wait():
            self.skipped = 0
            return True
        return False

    def record_rate(self, tokens: float, seconds: float, plain_tokens: float, plain_seconds: float) -> None:
        """One drafting round made ``tokens`` in ``seconds``; a plain step makes ``plain_tokens`` in ``plain_seconds``."""
        ratio = rate_over_plain(tokens, seconds, plain_tokens, plain_seconds)
        # Until ``1 / smoothing`` rounds are in, the plain mean of the rounds so far: a moving average
        # that starts at the first round lets that one round weigh as much as the next 1 / smoothing
        # together, and a first round that drafted badly then closed the gate for the run (measured on
        # the reference target, MTP-TTT3 on 3 chat prompts: drafting in 16 of 124 rounds, 0.97x plain
        # decoding; fixed length 1.07x; with this mean and expected gains 1.11x).
        self.rounds += 1
        self.efficiency = moving_average(self.efficiency, ratio, max(self.smoothing, 1 / self.rounds))
        self.lost_steps = max(0.0, seconds / plain_seconds - tokens / plain_tokens)
        self.backoff = 1 if self.paying else min(2 * self.backoff, self.max_backoff)


class _PacedPolicy:
    """What both D-cut policies share: the cost model, the pace of this machine against it, the
    calibration of confidences, and the settings of their draft gates (`DraftGate`)."""

    def __init__(self, cost_model: CostModel, explore_every: int = 8, smoothing: float = 0.2, max_backoff: int = 8,
                 probe_budget: float | None = None, track_pace: bool = True, close_below: float = 1.0):
        self.cost_model = cost_model
        # Moving average of (measured forward seconds) / (the cost model's seconds for it): 1 while the
        # machine runs at the profile's speed; None until a forward is recorded (read as 1).
        # ``track_pace=False`` takes the profile's seconds as this machine's (a synthetic cost model).
        self.track_pace = track_pace
        self.pace: float | None = None
        self.calibrator = Calibrator()
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.max_backoff = max_backoff
        self.probe_budget = probe_budget
        self.close_below = close_below
        self.decisions = 0
        self._new_gate()  # checks the gate's settings now, not at the first drafting round

    def _new_gate(self) -> DraftGate:
        return DraftGate(self.explore_every, self.smoothing, self.max_backoff, self.probe_budget, self.close_below)

    def record_forward(self, seconds: float, width: int, context: int, batch: int = 1) -> None:
        """A target forward of ``batch`` rows verifying ``width`` tokens each at ``context`` took ``seconds``.

        Why: drafting is timed on the wall clock and verification priced by a profile that may have
        been measured when the machine ran at another speed (a saved profile reused the next day, a
        shared machine in a slow spell). Mixing the two overprices drafting whenever the machine is
        slower than its profile, and the gate then closes on drafting that pays (measured on the
        reference target, engine at concurrency 4, DFly-Block8, with the machine's profile halved:
        drafting in 28-40 steps at tau 1.11-1.14 without the pace, 127-128 at tau 1.75-1.77 with it,
        as with the true profile). Drafting time divided by the pace is in the profile's time, where
        every comparison of the policy is made.
        """
        if not self.track_pace or seconds <= 0:
            return
        predicted = self.cost_model.verify_seconds(width, context, batch)
        if predicted > 0:
            self.pace = moving_average(self.pace, seconds / predicted, PACE_SMOOTHING)

    def in_profile_time(self, seconds: float) -> float:
        """Wall-clock seconds measured on this machine now, as the cost model's seconds."""
        return seconds / (self.pace or 1.0)


class DCutPolicy(_PacedPolicy):
    """Cost-aware draft cutting for one drafter at batch 1 (see the module docstring).

    Where greedy ``generate`` verifies first-token alternatives beside the chain, it passes their
    draft probabilities (``alternatives``) and the widest forward they may make
    (``alternatives_width``) to `keep_drafting` and `choose`, and to `observe` the ones verified and
    which the target took (``alternative_hit``): their own `Calibrator` learns how often a runner-up
    of a given draft probability is the target's token, and every cut is priced with them
    (`best_cut`)."""

    weighs_alternatives = True  # tells the candidate generator to pass the alternatives' keywords

    def __init__(self, cost_model: CostModel, explore_every: int = 8, smoothing: float = 0.05, max_backoff: int = 1,
                 probe_budget: float | None = None, track_pace: bool = True):
        # A slow moving average (about 20 rounds) at batch 1: a round that D-cut cuts to nothing still
        # cost its drafting, and with the engine's 0.2 (about 5 rounds) three such rounds in a row
        # closed the gate for 8 plain steps in the middle of code that paid (measured on the
        # reference target with DFly-Block8 on two code prompts: 1.09x / 1.04x with 0.2, 1.28x /
        # 1.13x with 0.05, 1.31x / 1.25x at fixed length; chat 0.89x / 1.03x -> 1.01x / 1.05x).
        # No backoff by default at batch 1: measured on the reference target, a sequential drafter
        # whose efficiency hovers near 1 lost its paying phases (MTP + D-cut on math: 1.17x without
        # backoff, 0.97x with it); in the engine, where a retry costs a whole batch, it pays.
        super().__init__(cost_model, explore_every, smoothing, max_backoff, probe_budget, track_pace)
        self.gate = self._new_gate()
        self.expected_gain: float | None = None  # what `choose` expected of the round being verified, for `observe`
        self.position_seconds: float | None = None  # moving average of drafting time per drafted position (profile time)
        self.longest_draft: int | None = None  # the most positions a round has drafted (exploration rounds draft all)
        self.drafted = 0  # positions the round being verified drafted (what `choose` saw)
        self.alternative_calibrator = Calibrator()  # a runner-up's draft probability -> how often the target takes it

    def verify(self, context: int):
        return lambda tokens: self.cost_model.verify_seconds(tokens, context)

    def should_draft(self) -> bool:
        return self.gate.should_draft()

    def keep_drafting(self, confidences: list[float], context: int, alternatives: list[float] | None = None,
                      alternatives_width: int = 0) -> bool:
        """Asked after each drafted token, so that sequential drafters stop early (exploration rounds never do)."""
        if (self.decisions + 1) % self.explore_every == 0:
            return True
        most = self.longest_draft if self.longest_draft is not None else self.cost_model.tokens[-1] - 1
        return worth_extending(survival_of([self.calibrator(c) for c in confidences]), self.verify(context),
                               max(most, len(confidences)), self.position_seconds or 0.0,
                               self._alternative_gains(alternatives), alternatives_width)

    def choose(self, confidences: list[float], context: int, alternatives: list[float] | None = None,
               alternatives_width: int = 0) -> int:
        self.decisions += 1
        self.drafted = len(confidences)
        self.longest_draft = max(self.longest_draft or 0, len(confidences))
        calibrated = [self.calibrator(c) for c in confidences]
        gains = self._alternative_gains(alternatives)
        sunk = (self.position_seconds or 0.0) * len(confidences)
        if self.decisions % self.explore_every == 0:
            keep = len(confidences)
        else:
            keep = best_cut(calibrated, self.verify(context), sunk, gains, alternatives_width)
        self.expected_gain = expected_tokens(survival_of(calibrated), keep) + alternatives_gain(
            keep, gains, alternatives_width)[0]
        return keep

    def _alternative_gains(self, alternatives: list[float] | None) -> list[float]:
        return [self.alternative_calibrator(confidence) for confidence in alternatives or ()]

    def observe(self, confidences: list[float], accepted: int, draft_seconds: float, context: int,
                alternatives: list[float] | None = None, alternative_hit: int | None = None) -> None:
        """Learn from a verified round: which kept positions were accepted, and what drafting cost.

        The gate weighs the round by what `choose` expected of it (calibrated survivals of the kept
        positions), as `BatchDCutPolicy.observe` does and for the same reason: at batch 1 a round
        accepts 0 or a few tokens, far noisier than its expectation, and the realised counts closed
        the gate on drafting that paid (measured on the reference target, DFly-Block8 on a math
        prompt: tau 1.38 where the fixed length had 1.91; with expected gains and the even start of
        `DraftGate.record_rate` 1.88). A round `choose` did not see counts as accepted.

        ``alternatives``: the draft probabilities of the first-token alternatives the forward verified
        beside the chain, and ``alternative_hit`` the one the target took (``accepted`` then counts
        the chain's own matches: none); they calibrate the alternatives and widen the priced forward."""
        for position, confidence in enumerate(confidences[: accepted + 1]):
            self.calibrator.update(confidence, position < accepted)
        for index, confidence in enumerate(alternatives or ()):
            self.alternative_calibrator.update(confidence, index == alternative_hit)
        drafted, self.drafted = max(self.drafted, len(confidences), 1), 0
        draft_seconds = self.in_profile_time(draft_seconds)
        self.position_seconds = moving_average(self.position_seconds, draft_seconds / drafted, self.smoothing)
        verify = self.verify(context)
        gained, self.expected_gain = self.expected_gain, None
        gained = accepted + 1 if gained is None else gained
        width = len(confidences) + 1 + len(alternatives or ())
        self.gate.record_rate(gained, draft_seconds + verify(width), 1, verify(1))


# About the last 10 forwards: a few seconds of decoding, shorter than the slow spells of a shared machine.
PACE_SMOOTHING = 0.1


def rate_over_plain(tokens: float, seconds: float, plain_tokens: float, plain_seconds: float) -> float:
    """A drafting round's tokens per second over a plain step's: what the draft gate calls efficiency."""
    return (tokens / seconds) / (plain_tokens / plain_seconds)


def moving_average(average: float | None, value: float, smoothing: float) -> float:
    """An exponential moving average; the first value starts it."""
    return value if average is None else (1 - smoothing) * average + smoothing * value


class ArmGate(DraftGate):
    """The draft gate of one drafter in a batched engine, with what it learnt of that drafter's
    steps: its drafting time per row and its latest measured step (for `BatchDCutPolicy.predicted_efficiency`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_draft_seconds: float | None = None  # moving average of drafting time per drafting row (profile time)
        self.last_step: _MeasuredStep | None = None
        self.drafting_rows = 0  # this drafter's rows that drafted in the step being verified (what `window` saw)
        self.expected_gain: float | None = None  # this drafter's share of what `window` expected of that step


# A drafter's first step in a batch (see `BatchDCutPolicy.should_draft`): its verify window may cost at
# most this many plain steps, searched up to `FIRST_WINDOW_LIMIT` tokens.
FIRST_STEP_COST = 2.0
FIRST_WINDOW_LIMIT = 64
# ... and it is taken only where a drafter whose positions are each accepted with this probability
# (given the ones before) would make at least `FIRST_STEP_MIN_EFFICIENCY` times plain decoding's tokens
# per second in such a window, its drafting not counted (`BatchDCutPolicy.first_step_efficiency`).
FIRST_STEP_ACCEPTANCE = 0.7
FIRST_STEP_MIN_EFFICIENCY = 1.35
# ... its window's time counting the reading of the decoded positions its rows' drafter missed while
# it did not draft, each at this share of the target's cheapest slot (`CostModel.slot_seconds`).
# Measured on the reference target (Intel Xeon with AMX, 2 threads, float32 profile: 2.64 ms a slot at
# context 416): 12 rows' first calls reading 2223 positions took 72 ms for DFlash-Block8, 61 ms for
# DFly-Block8 and 147 ms for MTP-TTT3 (1.2%, 1.0% and 2.5%; `logs/s62/router_c16.py`).
CATCH_UP_SHARE = 0.02


class BatchDCutPolicy(_PacedPolicy):
    """D-cut across the requests of a batched engine step (see the module docstring).

    The engine calls `should_draft` before drafting, `window` with every drafting row's raw
    confidences after it, and `observe` once the step's forward has been verified.

    Each drafter (``arm``, named by the engine; None for rows without a name) has its own draft
    gate (`ArmGate`) and calibration. Why: with a gate shared by every drafter of a routed batch,
    the requests settled on a drafter that did not pay (chat) pulled the shared efficiency below 1
    and closed drafting for the code and math requests another drafter served well (measured on the
    reference target, engine at concurrency 4 with the three shipped drafters and 9 mixed prompts:
    the router drafted in 41-119 steps where DFly-Block8 alone drafted in 127-137, and ran at 0.94x
    of DFly + D-cut's throughput). A drafter's gate weighs its own rows' expected tokens against its
    own drafting time and its rows' share of the step's verify forward (the drafting rows share the
    widening of the window; the rows that did not draft are shared out between the drafters in
    proportion to their drafting rows), which for one drafter is the step's own rate.

    ``probe_budget`` (default 0.5%) bounds the time that retries which do not pay may take (see
    `DraftGate`); ``None`` leaves only the doubling wait. Why 0.5% (2% until session 54): with the
    engine's prefill grouped, a pass of plain batched decoding at concurrency 16 takes a quarter
    less time, and the retries at a full batch, where drafting never pays on a CPU, weigh that much
    more. Paired with plain batched decoding on the main job's 32 requests (reference target, 2
    threads, 2 reps each, `logs/s54/budget_ab.py`): DFlash-Block8 + D-cut 0.949x / 0.950x with 2%
    (7-8 drafting steps), 0.978x / 0.972x with 0.5% (4); MTP-TTT3 + D-cut 0.989x / 0.987x against
    0.978x / 0.992x; the router over the three at concurrency 4 1.247x / 1.266x against 1.277x /
    1.269x. (Session 50 had found 0.5% level with 2%, 1.075x against 1.067x, inside its spread.)

    Each gate averages about 20 drafting steps (``smoothing`` 0.05) and closes below 1, as batch 1's
    does. Why not a short average with a margin (0.2 and 0.9 until session 52): the margin kept a
    drafter drafting that ran at 0.9-1.0x plain decoding, and on chat-only traffic at concurrency 4
    DFly-Block8 did (0.97x; 0.99-1.00x with this gate, level on code and mixed traffic, docs/dcut.md),
    while the long average rides out the single-step dips that the margin was there for.
    """

    def __init__(self, cost_model: CostModel, explore_every: int = 8, smoothing: float = 0.05, max_backoff: int = 8,
                 probe_budget: float | None = 0.005, track_pace: bool = True, close_below: float = 1.0):
        super().__init__(cost_model, explore_every, smoothing, max_backoff, probe_budget, track_pace, close_below)
        self.windows: list[int] = []  # chosen window of every drafting step, for reports
        self.gates: dict[str | None, ArmGate] = {}
        # One calibration per drafter: rows of a routed engine draft with different drafters, whose
        # confidences mean different acceptance rates (``self.calibrator`` serves rows without a name).
        self.calibrators: dict[str, Calibrator] = {}

    def _new_gate(self) -> ArmGate:
        return ArmGate(self.explore_every, self.smoothing, self.max_backoff, self.probe_budget, self.close_below)

    def gate_for(self, arm: str | None = None) -> ArmGate:
        gate = self.gates.get(arm)
        if gate is None:
            gate = self.gates[arm] = self._new_gate()
        return gate

    def reopen(self, arm: str | None = None) -> None:
        """Forget what ``arm``'s gate measured: it drafts again as an unmeasured drafter (its first
        step where a miss is cheap, `should_draft`). For a router whose request found the drafter far
        ahead on its own text, which the gate, measured on other requests' rows, had not seen."""
        self.gates.pop(arm, None)

    def measured(self, arm: str | None = None) -> bool:
        """Whether ``arm``'s gate has measured its drafting: an unmeasured drafter is open only for
        want of evidence (the engine moves a settled request off a closed drafter only to a measured one)."""
        gate = self.gates.get(arm)
        return gate is not None and gate.efficiency is not None

    def is_open(self, arm: str | None = None, batch: int | None = None, context: int | None = None,
                queued: bool = True) -> bool:
        """Whether ``arm``'s drafting has been paying (True before it is measured), or, given the
        step's ``batch``, ``context`` and ``queued``, would pay there (`reopens`): a router weighs it
        when choosing a drafter, since rows on a closed one decode plainly until it reopens.

        Why the step's conditions: a drafter no row uses is never asked `should_draft`, so its gate
        never sees the batch shrink; closed under load, it stayed closed to every later request for
        the engine's life, however small the batch became."""
        gate = self.gates.get(arm)
        if gate is None or gate.paying:
            return True
        return batch is not None and context is not None and self.reopens(arm, batch, context, queued)

    def reopens(self, arm: str | None, batch: int, context: int, queued: bool) -> bool:
        """Whether ``arm``'s closed gate would pay at these conditions by `predicted_efficiency`
        (only repriced under the objective it was measured under: ``queued`` as then)."""
        gate = self.gate_for(arm)
        last = gate.last_step
        if gate.efficiency is None or last is None or last.queued != queued:
            return False
        return self.predicted_efficiency(batch, context, arm) >= self.close_below

    def calibrator_for(self, arm: str | None) -> Calibrator:
        if arm is None:
            return self.calibrator
        return self.calibrators.setdefault(arm, Calibrator())

    def verify(self, batch: int, context: int):
        return lambda width: self.cost_model.verify_seconds(width, context, batch)

    def first_window(self, batch: int, context: int) -> int:
        """The widest verify window up to which every window costs at most `FIRST_STEP_COST` plain steps
        at ``batch`` rows and ``context``: what a drafter's first, unmeasured step may verify (see
        `should_draft`). It stops at the first window priced above that, even where a wider one is
        priced below it again (the profile is not monotone in new tokens): a first step is a guess, so
        it is kept to the windows the profile prices cheap throughout."""
        verify = self.verify(batch, context)
        limit, width = FIRST_STEP_COST * verify(1), 1
        while width < FIRST_WINDOW_LIMIT and verify(width + 1) <= limit:
            width += 1
        return width

    def first_step_efficiency(self, batch: int, context: int, catch_up: int = 0) -> float | None:
        """Tokens per second over plain decoding's of the best window up to `first_window` at
        ``batch`` rows and ``context``, for a drafter whose positions are each accepted with
        probability `FIRST_STEP_ACCEPTANCE` once the ones before them are, its drafting free but
        for its reading of ``catch_up`` decoded positions it missed (`CATCH_UP_SHARE`); None where no draft
        token fits (`first_window` is 1)."""
        verify = self.verify(batch, context)
        reading = catch_up * CATCH_UP_SHARE * self.cost_model.slot_seconds(context) if catch_up else 0.0
        survival = survival_of([FIRST_STEP_ACCEPTANCE] * (self.first_window(batch, context) - 1))
        return max((rate_over_plain(batch * expected_tokens(survival, width - 1), reading + verify(width), batch,
                                    verify(1)) for width in range(2, len(survival) + 2)), default=None)

    def first_step_pays(self, batch: int, context: int, catch_up: int = 0) -> bool:
        """Whether a drafter's first, unmeasured step may be taken at ``batch`` rows and ``context``,
        its rows' drafter having ``catch_up`` decoded positions to read first: its `first_step_efficiency`
        is at least `FIRST_STEP_MIN_EFFICIENCY` (see `should_draft`)."""
        efficiency = self.first_step_efficiency(batch, context, catch_up)
        return efficiency is not None and efficiency >= FIRST_STEP_MIN_EFFICIENCY

    def should_draft(self, batch: int | None = None, context: int | None = None, queued: bool = True,
                     arm: str | None = None, catch_up: int = 0) -> bool:
        """Whether ``arm``'s rows draft this step: while its drafting pays; else when
        `predicted_efficiency` says the batch or context has changed enough that it would pay now;
        else on the timed retries of `DraftGate`. The engine passes the step's active rows, context
        and queue state, and asks once per drafter; ``catch_up``: the decoded positions that drafter
        has yet to read for its rows (priced into a first step only).

        A drafter's first step, taken on raw confidences, waits for a batch and context at which a
        miss is cheap: where verifying one draft token per row costs at most `FIRST_STEP_COST` plain
        steps, and its window is capped at `first_window` there. Why: on a CPU a full batch is
        compute-bound (reference target, concurrency 16: a window of 2 costs 2.0x a plain step, of 8
        3.9x), so the first step drafted 7 tokens a row, had every drafter read every row's prompt,
        and cost about 0.7% of a pass each; the router took three of them (one per drafter). Deferred
        (paired with plain batched decoding, the main job's 32 requests, 2 reps each,
        `logs/s54/safe_first_ab.py`): the router 0.925x / 0.946x -> 0.962x / 0.992x; one more rep each
        (`logs/s54/first_window_ab.py`): DFlash-Block8 + D-cut 0.958x -> 0.998x, the router 0.949x ->
        0.982x, and at concurrency 4, where the cap is 8 or more, the router 1.277x. Where a forward is
        not compute-bound (a GPU, small batches) nothing changes.

        Nor is it taken where even a good drafter would only about break even (`first_step_pays`):
        1.35 times plain decoding's rate for positions accepted at 0.7 each, drafting not counted,
        leaves room for a block drafter's call at the full batch (about a quarter of a plain step on
        the reference CPU) and the first call's reading of every prompt. Why: where a window of 2
        costs under two plain steps (concurrency 16 on the reference target, Intel Xeon with AMX,
        float32: 1.42x, a window of 4 2.06x; 0.7 per position makes 1.26x there) the first step ran
        at the full batch, the gate read 1.0-1.07 for 7-15 steps before it closed, and those steps,
        with the ragged ends of the pass they left, cost 2-5%: paired with plain batched decoding
        on the main job's 32 requests (`logs/s61/ab.py`), before and after this rule: DFlash-Block8 +
        D-cut 0.973x / 0.961x / 0.959x -> 0.995x / 0.984x, DFly-Block8 + D-cut 0.960x / 0.931x / 0.950x
        -> 0.997x / 0.982x, MTP-TTT3 + D-cut 0.968x / 0.962x -> 0.992x / 1.006x, the router 0.944x /
        0.946x -> 0.973x / 0.965x; the engine with its gate forced shut 1.001x / 0.994x / 0.991x.

        The first step's price also counts the drafter's reading of the decoded positions it missed
        while it did not draft (``catch_up``, `CATCH_UP_SHARE`; the prompts' reading is what the
        margin above is for, since every request pays it whenever drafting starts). Why: deferred at
        the full batch, the first step came once the queue had emptied and the batch had shrunk to
        12 rows, whose drafter then read about 100 decoded positions a row besides the prompts
        before drafting, where a good drafter without them was priced at 1.37x (reference target,
        concurrency 16: the router's first step read 2223 positions with each of its three drafters,
        649 ms against a plain step's 129, and D-cut then verified nothing; `logs/s62/router_c16.py`).
        The engine counts the drafters of the probes beside the row's drafter too; paired with plain
        batched decoding (main job's 32 requests, `logs/s62/ab.py`, four reps) the router then ran at
        0.983x-0.986x with no drafting step, against 0.968x-0.972x with 5-6 steps before."""
        gate = self.gate_for(arm)
        if (gate.efficiency is None and batch is not None and context is not None
                and not self.first_step_pays(batch, context, catch_up)):
            return False
        # A step under the other objective (the queue filled or emptied) is not repriced: timed retries.
        if not gate.paying and batch is not None and context is not None and self.reopens(arm, batch, context, queued):
            gate.skipped = 0
            return True
        return gate.should_draft()

    def predicted_efficiency(self, batch: int, context: int, arm: str | None = None) -> float:
        """``arm``'s efficiency carried over to a step of ``batch`` rows at ``context``: its last
        drafting step's gain, drafting share and window repriced with the cost model, relative to
        what they were worth where they were measured. Unchanged conditions give the efficiency
        itself, so only a real change (rows leaving, contexts growing) reopens the gate.

        Why: timed retries at unchanged conditions cannot tell a batch that has shrunk to where
        drafting pays (the end of a concurrency-16 run, where the longest requests finish alone)
        from one where it still loses, and each costs a whole batch's drafting round (on the
        reference CPU with 12 rows 0.3-0.7 plain steps). A step whose window was cut to nothing
        reprices as nothing, so only the timed retries reopen the gate after it."""
        gate = self.gate_for(arm)
        if gate.efficiency is None or gate.last_step is None:
            raise ValueError("predicted_efficiency needs a measured drafting step first")
        last = gate.last_step
        return gate.efficiency * last.relative_rate(self, gate, batch, context) / last.relative_rate(
            self, gate, last.batch, last.context)

    def window(self, confidences: list[list[float]], batch: int, context: int, queued: bool = True,
               remaining: list[int] | None = None, arms: list[str] | None = None) -> int:
        """Verify window for this step (1 = no drafts); ``confidences`` of the rows that drafted;
        ``remaining``: tokens still to generate for every active row, the drafting rows first in the
        order of ``confidences`` (see `best_window`); ``arms``: the drafter each drafting row used,
        in the same order, so that each drafter's confidences are calibrated and gated on their own.

        ``queued``: whether requests wait for a slot. If they do, every accepted token frees capacity
        for them and tokens per second summed over rows is what to maximise; if not, the run ends
        with its longest request, and the step's worth is the progress of its slowest row (measured
        on the reference target at concurrency 16 with 12 requests, nothing waiting: the summed
        objective drafted in 14 steps whose 222 accepted tokens saved 4 of 128 forwards, and the
        run was 8% slower than plain batched decoding).
        Every ``explore_every``-th decision keeps whole drafts, so calibration sees every depth.
        """
        self.decisions += 1
        longest = max((len(c) for c in confidences), default=0)
        arms = arms if arms is not None else [None] * len(confidences)
        survivals = [survival_of([self.calibrator_for(arm)(c) for c in row]) for row, arm in zip(confidences, arms)]
        if self.decisions % self.explore_every == 0:
            width = longest + 1
        else:
            sunk = sum(self.gate_for(arm).row_draft_seconds or 0.0 for arm in arms)
            width = best_window(survivals + [[]] * (batch - len(confidences)), self.verify(batch, context),
                                slowest_row=not queued, sunk_seconds=sunk, remaining=remaining)
        if any(self.gate_for(arm).efficiency is None for arm in dict.fromkeys(arms)):
            width = min(width, self.first_window(batch, context))
        for arm in dict.fromkeys(arms):
            gate = self.gate_for(arm)
            gate.drafting_rows = arms.count(arm)
            gate.expected_gain = self._arm_progress(arm, arms, survivals, batch, width, queued, remaining)
        self.windows.append(width)
        return width

    @staticmethod
    def _arm_progress(arm, arms: list, survivals: list[list[float]], batch: int, width: int, queued: bool,
                      remaining: list[int] | None) -> float:
        """``arm``'s share of what a step of ``width`` is expected to achieve (see `step_progress`):
        its own rows' tokens plus, in proportion to its drafting rows, the rows that did not draft."""
        mine = [i for i, a in enumerate(arms) if a == arm]
        share = len(mine) / len(arms)
        undrafted = batch - len(arms)
        if queued:
            return sum(expected_tokens(survivals[i], width - 1) for i in mine) + share * undrafted
        rows = [survivals[i] for i in mine] + [[]] * undrafted
        left = None if remaining is None else [remaining[i] for i in mine] + remaining[len(arms):]
        return share * step_progress(rows, width, slowest_row=True, remaining=left)

    def observe(self, kept: list[tuple[list[float], int]], batch: int, width: int, context: int,
                draft_seconds: float | dict, queued: bool = True, arms: list[str] | None = None) -> None:
        """Learn from a verified step: per drafting row its kept confidences and accepted count,
        plus what the step's drafting cost (in total, or per drafter as ``{arm: seconds}``);
        ``queued`` and ``arms`` as in `window`.

        Each drafter's gate weighs the step by what `window` expected of its rows (calibrated
        survivals of the window it chose), not by what was accepted: a few rows' acceptances vary
        far more from step to step than their expectation, and the realised counts closed the gate
        where drafting paid (measured on the reference target, engine at concurrency 4,
        DFly-Block8, 12 mixed prompts: 1.09x plain batched decoding gated on realised counts, 1.28x
        / 1.36x with the gate held open, fixed windows of 4 / 8 tokens 1.34x / 1.16x). A step
        `window` did not see counts as accepted."""
        arms = arms if arms is not None else [None] * len(kept)
        for (confidences, accepted), arm in zip(kept, arms):
            calibrator = self.calibrator_for(arm)
            for position, confidence in enumerate(confidences[: accepted + 1]):
                calibrator.update(confidence, position < accepted)
        drafting = {arm: gate for arm, gate in self.gates.items() if gate.drafting_rows}
        for arm in arms:
            drafting.setdefault(arm, self.gate_for(arm))
        if not drafting:
            drafting[None] = self.gate_for(None)
        rows = {arm: max(gate.drafting_rows, arms.count(arm), 1) for arm, gate in drafting.items()}
        seconds = self._split_draft_seconds(draft_seconds, rows)
        verify = self.verify(batch, context)
        plain = batch if queued else 1
        total_rows = sum(rows.values())
        for arm, gate in drafting.items():
            share = rows[arm] / total_rows
            gate.drafting_rows = 0
            arm_seconds = self.in_profile_time(seconds[arm])
            gate.row_draft_seconds = moving_average(gate.row_draft_seconds, arm_seconds / rows[arm], self.smoothing)
            gained, gate.expected_gain = gate.expected_gain, None
            if gained is None:
                mine = [accepted for (_, accepted), a in zip(kept, arms) if a == arm]
                if queued:
                    gained = share * batch + sum(mine)
                else:  # rows that did not draft advanced one token, like a plain step
                    gained = share * (1 + (min(mine) if mine and len(kept) == batch else 0))
            # The step as if every drafting row were this drafter's, to reprice it elsewhere.
            gate.last_step = _MeasuredStep(batch, context, queued, width, total_rows / batch, gained / share)
            gate.record_rate(gained, arm_seconds + share * verify(width), share * plain, share * verify(1))

    @staticmethod
    def _split_draft_seconds(draft_seconds: float | dict, rows: dict) -> dict:
        """Drafting seconds per drafter: as given, or a total shared out by drafting rows."""
        if isinstance(draft_seconds, dict):
            return {arm: draft_seconds.get(arm, 0.0) for arm in rows}
        total = sum(rows.values())
        return {arm: draft_seconds * count / total for arm, count in rows.items()}


@dataclass
class _MeasuredStep:
    """A drafting step as `BatchDCutPolicy` measured it for one drafter, enough to reprice it elsewhere."""

    batch: int
    context: int
    queued: bool
    width: int
    drafting_share: float  # fraction of the active rows that drafted
    gain: float  # in the step's objective: tokens summed over rows if queued, else the slowest row's

    def relative_rate(self, policy: BatchDCutPolicy, gate: ArmGate, batch: int, context: int) -> float:
        """Tokens per second of this step at ``batch`` rows and ``context``, over a plain step's there."""
        # The summed objective grows with the rows; the slowest row's progress does not.
        gain = self.gain * batch / self.batch if self.queued else self.gain
        verify = policy.verify(batch, context)
        drafting = (gate.row_draft_seconds or 0.0) * self.drafting_share * batch
        plain = batch if self.queued else 1
        return rate_over_plain(gain, drafting + verify(self.width), plain, verify(1))
