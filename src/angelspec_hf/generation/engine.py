"""A batched speculative engine: many requests at once, each accepting its own number of tokens.

All rows share one KV cache with the same physical length. Every forward appends a window of
slots to every row: the row's pending token and its drafts, left-aligned, the rest padding.
Slots that turn out rejected (or were padding) stay in the cache but are masked out of
attention for good, and positions are passed explicitly, so each row sees exactly its own
committed tokens at their true positions. Requests join when a slot is free (their prompts are
prefilled apart, in groups of similar length, and the caches merged in) and leave when they finish.

With several drafters (``{name: drafter}``) each request uses the one named by its declared
domain; a request without a known domain is routed online. Its first drafting rounds are probes
in which every candidate drafter drafts for it but only one, the live arm (the best by the
evidence so far), is verified: the others' drafts are shadows, scored afterwards against the
tokens the request commits, which under greedy decoding is exactly what verifying them would
have accepted. Each arm (and "no drafter", one token a round) is scored by tokens gained per
second of its own drafting plus the round's share of the verify forward, on the same positions
of the request's own text, and the request keeps the best arm. Probing so costs only the extra
drafting (a draft is a small fraction of a verify forward), where probing by verifying each arm
in turn spent whole rounds on arms that lose. A few probes are still a noisy sample, so every
probe also feeds evidence pooled over the engine's requests: a request's choice weighs its own
probes against the pooled rate of each arm, and an arm that was not competitive in the probes of
any of the last requests that tried it is no longer probed by the requests that join later
(judged request by request, not on pooled rates: in a mixed workload the drafter that loses on
chat can be the best one on code). A drafter the policy keeps closed (its drafting does not pay
at this batch) is not settled on while another one drafts, and a request whose drafter the
policy closes after it settled moves, once, to the open drafter it probed best. A candidate
drafter ingests the request's context only when it drafts (it catches up on what it missed
then), so after the probes the drafters a request keeps idle hold only the states they have not
read, and those it dropped cost nothing. Under sampling a shadow is scored against the
sampled tokens, which undercounts what speculative sampling would accept, alike for every arm.

Drafting reuses the drafters' own candidate generators, one per row, fed with that row's slice
of the verify forward's hidden states; each drafter then drafts for all its rows in one batched
forward (``propose_many``), since a row-by-row drafting round cost two plain batched steps at
concurrency 16 on the reference CPU. Greedy: each row's output is what plain greedy decoding of
that row gives (up to the floating-point differences any batched forward has, which can flip a
near-tie). Sampling: each row runs the speculative-sampling acceptance rule on its own drafts
(accept with probability min(1, p/q), resample from max(p - q, 0) at the first rejection), with
temperature/top-k/top-p applied to draft and target alike, so every row samples from the
target's distribution.
"""

from __future__ import annotations

import inspect
import logging
import numbers
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import StopStringCriteria

from ..errors import AngelSpecError, UnsupportedCacheError
from ..modeling_angelspec_common import sample_tokens, wait_for_device
from .buffered_cache import BufferedCache
from .dcut import FixedLengthPolicy, moving_average
from .exact import ATTENTION_NAME

logger = logging.getLogger(__name__)

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Cache layers that store nothing: layers that read another layer's keys and values (Gemma 4's KV
# sharing) or have no attention. The engine's cache (built without the config) never creates them.
CACHELESS_LAYER_TYPE = "dummy"
# Families whose position information is counted over cache columns rather than taken from
# position_ids or the attention mask: MPT's ALiBi biases each key by its column's distance from the
# last column, so the engine's shared columns (other rows' padding, rejected drafts) would shift
# them. Found by decoding every row of tiny targets of 29 families against plain `generate`
# (session 46); BLOOM's and Falcon's ALiBi count the attention mask and are exact.
COLUMN_POSITION_FAMILIES = ("mpt",)


def attention_windows(target) -> dict[str, int | None] | None:
    """The target's attention layer types and their windows (``None``: full attention), or
    ``None`` when every layer attends to the whole context.

    Why the engine asks: its cache keeps a row's tokens at physical columns shared with other rows
    and with masked-out rejected drafts, so the distance between two columns is not the distance
    between two positions. transformers' sliding-window masks (built from physical columns) and
    sliding cache layers (which drop the oldest columns) would both cut the wrong keys; the engine
    builds sliding-window masks from each row's own positions over a full cache instead.
    """
    config = target.config.get_text_config(decoder=True)
    if config.model_type in COLUMN_POSITION_FAMILIES:
        raise UnsupportedCacheError(
            f"SpeculativeEngine cannot serve {config.model_type}: its ALiBi position biases count cache columns, "
            "which the engine shares between rows and rejected drafts. Decode its requests one at a time with "
            "target.generate(assistant_model=drafter, use_cache=True) instead."
        )
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    other = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES) - {CACHELESS_LAYER_TYPE})
    if other:
        fix = ("Their recurrent state cannot be rolled back after a rejected draft, so speculative decoding "
               "(transformers' assisted generation too) does not apply to this target."
               if getattr(target, "_is_stateful", False) else
               "Decode its requests one at a time with target.generate(assistant_model=drafter) instead.")
        raise UnsupportedCacheError(
            f"SpeculativeEngine serves targets whose layers use full or sliding-window attention; "
            f"{config.model_type} also has {other} layers. {fix}"
        )
    windows: dict[str, int | None] = {}
    for layer_type, kwargs in zip(layer_types, layer_kwargs):
        if layer_type == CACHELESS_LAYER_TYPE:
            continue
        window = kwargs.get("sliding_window")
        if windows.setdefault(layer_type, window) != window:
            raise UnsupportedCacheError(
                f"SpeculativeEngine needs one sliding window for all of {config.model_type}'s {layer_type} layers, "
                f"got {windows[layer_type]} and {window}. Use target.generate(assistant_model=drafter) instead."
            )
    return None if set(windows) == {"full_attention"} else windows


# Prefill grouping (`prefill_groups`). A padded slot costs as much as a real token, and batching
# prompts pays only up to a few hundred tokens a forward: on the reference target (2 threads, last
# logits only) a 64-token prompt took 2.4 ms a token alone, 1.4 in a batch of 4, 1.2 in a batch of
# 16; 160- and 320-token ones 1.7 and 1.5 alone, 1.3 in a batch of 4, 1.3 and 1.45 in a batch of 16.
# Joining 16 prompts of 44-378 tokens padded to the longest had spent 7.5 s of a 43 s concurrency-16 pass.
PREFILL_PADDING = 0.25  # padded slots a group may add, as a share of its real tokens
PREFILL_TOKENS = 2048  # padded slots of one prefill forward (a prompt longer than that goes alone)


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING,
                   max_tokens: int = PREFILL_TOKENS) -> list[list[int]]:
    """Indices of prompts of ``lengths`` grouped for one prefill forward each, longest first: a prompt
    joins the current group while the group padded to its longest prompt stays within ``1 + padding``
    times its real tokens and within ``max_tokens`` slots."""
    groups: list[list[int]] = []
    real = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            group = groups[-1]
            padded = lengths[group[0]] * (len(group) + 1)
            if padded <= (1 + padding) * (real + lengths[index]) and padded <= max_tokens:
                group.append(index)
                real += lengths[index]
                continue
        groups.append([index])
        real = lengths[index]
    return groups


class EngineRequestError(AngelSpecError, ValueError):
    """One request could not be served (empty or too long prompt, bad ids); the others were."""


NO_DRAFTER = "none"
# Requests that must have probed an arm before it may be dropped from the arms later requests probe.
PRUNE_AFTER_REQUESTS = 4
# How much better than the batch's own drafter, by the pooled evidence of every request, a drafter
# must be for a request to start drafting with it beside the others anyway (see `_batch_choice`).
MIGRATE_MARGIN = 0.1
# How many times the best open drafter's rate a request's own probes must give a drafter the policy
# keeps closed for the request to settle on it and have the policy measure it afresh (`_settling_arms`).
REOPEN_FACTOR = 1.5
# Weight of the newest measurement in the engine's moving averages of step and drafting-call times.
TIMING_SMOOTHING = 0.2


def steady_call_seconds(observe_seconds: float, propose_seconds: float, latest_shares: list[float]) -> float:
    """What a drafting call costs a step once its rows are caught up: the proposing, plus the share
    of the ingesting that was the latest verify forward's states (``latest_shares``, one per row;
    the rest was catch-up, a joining request's prompt included, paid once per request).

    Why: `_split_threshold` prices a drafter's call on every later step of the batch, and a call that
    also read a new request's prompt is not what those steps will cost."""
    if not latest_shares:
        return observe_seconds + propose_seconds
    return observe_seconds * sum(latest_shares) / len(latest_shares) + propose_seconds


def call_seconds_at(samples: dict[int, float], rows: int) -> float | None:
    """A drafting call's seconds for ``rows`` rows, read off ``samples`` (rows -> seconds of calls
    of that many rows) by a least-squares line, kept non-negative in slope and intercept; None
    until calls of two different sizes have been timed.

    Why a line: a drafting call has a fixed part (weights read, kernels launched) and a part per
    row. On the reference CPU at concurrency 4 a DFlash-Block8 call took 8 ms for one row and 13.5
    for four, so neither the per-row share of one size nor the whole call prices another size."""
    if len(samples) < 2:
        return None
    sizes = list(samples)
    mean_n = sum(sizes) / len(sizes)
    mean_t = sum(samples.values()) / len(sizes)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = max(0.0, sum((n - mean_n) * (samples[n] - mean_t) for n in sizes) / spread)
    intercept = mean_t - slope * mean_n
    if intercept < 0:  # steeper than proportional: the line through the origin instead
        slope, intercept = sum(n * samples[n] for n in sizes) / sum(n * n for n in sizes), 0.0
    return intercept + slope * rows


@dataclass
class _Probe:
    """One arm's draft in a routed request's probe round, scored once the request has committed
    the tokens it drafted for (or ended)."""

    arm: str
    start: int  # index in the row's tokens of the first drafted position
    tokens: list[int]
    draft_seconds: float
    verify_seconds: float | None = None  # the round's per-row share of the verify forward


@dataclass
class _Row:
    index: int
    tokens: list[int]
    prompt_length: int
    max_new_tokens: int
    domain: str | None = None
    generators: dict = field(default_factory=dict)  # arm -> candidate generator, while it may be used
    arm: str = NO_DRAFTER
    probing: list[str] = field(default_factory=list)  # arms this request still scores (empty: settled)
    probes: list[_Probe] = field(default_factory=list)  # drafted probes not scored yet
    arm_scores: dict = field(default_factory=dict)  # arm -> [tokens, seconds, rounds] of this request's scored probes
    switches: int = 0  # moves off a drafter the policy closed (see `_leave_closed_drafter`)
    # arm -> hidden states of the row's committed positions that arm's drafter has not ingested
    # yet, one entry per forward; a drafter ingests only when it drafts.
    pending: dict = field(default_factory=dict)
    draft_logits: torch.Tensor | None = None  # processed draft logits of the current round (sampling)
    draft_seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)
    # With state capture: (layers, n, H) features and (n, H) final states of committed positions.
    captured: list = field(default_factory=list)
    flushed: bool = False  # the last token's states are captured too (it is never verified otherwise)
    eos: frozenset = frozenset()
    do_sample: bool = False
    processors: LogitsProcessorList = field(default_factory=LogitsProcessorList)  # sampling warpers
    emitted: int = 0  # new tokens already reported in events
    stop: StopStringCriteria | None = None  # the request's stop strings, matched as `generate` does
    stopped: bool = False  # its text ended in a stop string

    @property
    def generator(self):
        return self.generators.get(self.arm)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def tokens_left(self) -> int:
        return self.max_new_tokens - self.new_tokens


@dataclass
class EngineEvent:
    """What one engine step did for one request: the tokens it committed (a joining request's
    first one included), whether it finished, and for a request that could not be served its error."""

    request: int
    tokens: list[int]
    finished: bool = False
    error: EngineRequestError | None = None


def _until_stop(row: "_Row", new: list[int]) -> list[int]:
    """The tokens of ``new`` a row keeps: up to and with the first EOS, or the first that completes one
    of its stop strings (``row.stopped``), checked token by token as ``generate``'s criteria are."""
    for j, token in enumerate(new):
        if token in row.eos:
            return new[: j + 1]
        if row.stop is not None and bool(row.stop(torch.tensor([row.tokens + new[: j + 1]]), None)[0]):
            row.stopped = True
            return new[: j + 1]
    return new


def _window_positions(row: "_Row", width: int, device) -> torch.Tensor:
    """Positions of a row's ``width`` verify slots: its own from the pending token on, but none past
    the slot of the last token the row may still keep. The slots beyond (padding beside longer
    windows, drafts past the row's budget) give results that are dropped, yet their positions are
    read: GPT-2's learned positions raised IndexError past the target's limit, killing the batch,
    and dynamic RoPE rescales every row's frequencies from the largest position in the forward,
    which changed other rows' tokens."""
    first = len(row.tokens) - 1
    return (first + torch.arange(width, device=device)).clamp_(max=first + max(row.tokens_left - 1, 0))


def _token_ids(value, what: str) -> list[int]:
    """``value`` (an int, a sequence of ints, a numpy array or a tensor of at most one dimension) as
    token ids; `EngineRequestError` naming ``what`` for anything else (nested lists, strings, floats:
    a float id was silently truncated before)."""
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise EngineRequestError(f"{what} must be token ids (ints), one sequence; could not read {value!r:.80} "
                                 f"({error}).") from None
    integral = ids.numel() == 0 or not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
    if ids.dim() > 1 or not integral:
        raise EngineRequestError(f"{what} must be token ids (ints), one sequence; got {ids.dim()} dimensions of "
                                 f"{ids.dtype}. Fix: pass one list of ints per request.")
    return [int(i) for i in ids.flatten().tolist()]


def _eos_set(eos_token_id) -> frozenset:
    """End-of-sequence ids from an int, a list, a numpy integer or a 0-d/1-d tensor, as ``generate`` takes
    them (a tensor's ids were never matched before: a frozenset of tensors)."""
    return frozenset(_token_ids(eos_token_id, "eos_token_id")) if eos_token_id is not None else frozenset()


def _is_integer(value) -> bool:
    """An int or numpy integer; not a bool, a float or a tensor."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _max_new_tokens(value) -> int:
    """``max_new_tokens`` as an int of at least 1, else `EngineRequestError` (0 or a negative count
    still emitted one token, and a float one broke the slicing of the whole batch's step)."""
    if not _is_integer(value) or value < 1:
        raise EngineRequestError(f"max_new_tokens must be an integer of at least 1, got {value!r}.")
    return int(value)


def _pad_left(tensor: torch.Tensor, length: int, dim: int, value=0) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_full(shape, value), tensor], dim=dim)


class SpeculativeEngine:
    """Serve many prompts at once with a target and an optional drafter (``None``: plain batched AR).

    >>> engine = SpeculativeEngine(target, drafter, max_batch_size=16)
    >>> outputs = engine.generate([prompt_ids_1, prompt_ids_2], max_new_tokens=128)

    Streaming, and requests that arrive while others are decoded (each with its own settings):

    >>> for event in engine.stream([prompt_ids_1, prompt_ids_2], max_new_tokens=128):
    ...     print(event.request, tokenizer.decode(event.tokens), event.finished)
    >>> request = engine.submit(prompt_ids_3, max_new_tokens=64, do_sample=True, temperature=0.7)
    >>> while engine.has_work:
    ...     for event in engine.step():
    ...         ...  # new tokens of every request that gained some; submit more at any time

    With ``policy=BatchDCutPolicy(load_or_profile(target, name))`` the verify window of every
    step is chosen across the batch and each drafter's rows stop drafting when it does not pay (a
    policy of your own needs ``should_draft(batch, context, queued, arm)``, asked once per drafter
    a step (with ``catch_up`` where it takes that keyword: the decoded positions that drafter, and
    the drafters of probes beside it, have yet to read for its rows, `_catch_up`), ``window(confidences,
    batch, context, queued, remaining, arms)`` and ``observe(outcomes, batch, width, context,
    draft_seconds, queued, arms)``; ``queued`` says whether requests wait for
    a slot, ``remaining`` lists the active rows' tokens still to generate, the drafting rows' first,
    in the order of ``confidences``, ``arms`` names the drafter of each drafting row, in the same
    order, and ``draft_seconds`` maps each drafter that drafted to its time; optionally
    ``record_forward(seconds, width, context, batch)``, told how long every verify forward took,
    ``is_open(arm)``, whether a drafter's drafting pays, which routing weighs, with keywords
    ``batch``, ``context`` and ``queued`` where it takes them, to reprice a closed drafter at the
    step; ``reopen(arm)``, to measure a closed drafter afresh once a request's own probes find it far
    ahead of the open ones; and ``measured(arm)``, whether the policy has measured that drafter, since
    a settled request leaves a closed drafter only for a measured open one). After a call, ``stats``
    holds one entry per request: its rounds, tokens accepted per round, the drafter it ended on
    and, for a routed request, ``probes``: arm -> (tokens, seconds, rounds) of its scored probes.
    ``arm_evidence`` holds the pooled evidence of every scored probe: arm -> (tokens,
    seconds, rounds); it lives as long as the engine, so a serving engine keeps learning across
    `generate` calls (``arm_evidence.clear()`` forgets it, for example when the workload changes).

    Routing: ``probe_rounds`` probes per arm, drafted side by side in the request's first drafting
    rounds while the pooled best arm (the first drafter before there is evidence; the batch's own
    drafter unless the pooled best is `MIGRATE_MARGIN` ahead of it) is verified, each probe's drafting
    priced at its share of a call for the whole batch (``call_sizes``: arm -> rows -> seconds of its
    calls). The request then settles on the arm with the best rate, its own probes weighed against the pooled
    evidence (a drafter the policy keeps closed only if every drafter is closed; a request whose
    drafter the policy closes moves to an open one, once settled only to one the policy has
    measured: ``switches`` in its stats), and on a drafter the batch's other rows draft with unless
    drafting another for it alone pays for that drafter's extra call (`_batch_choice`; ``call_seconds`` and
    ``step_seconds`` hold the timings it reads); settled requests that alone draft with a drafter move
    together onto one the batch's other rows draft with once that split no longer pays as the batch
    changes (`_consolidate`, counted in ``switches``). An arm is competitive for a request when its own
    probes' rate is at least ``1 - route_margin`` of the request's best arm's (``arm_record``: arm
    -> [competitive, probed] requests); one competitive for none of at least
    `PRUNE_AFTER_REQUESTS` requests is not probed by later ones.
    """

    def __init__(self, target, drafter=None, max_batch_size: int = 16, probe_rounds: int = 2, policy=None,
                 route_margin: float = 0.25, tokenizer=None):
        if drafter is None:
            drafters = {}
        elif isinstance(drafter, dict):
            drafters = dict(drafter)
        else:
            drafters = {"drafter": drafter}
        for model in drafters.values():
            model.check_target(target)
        if not _is_integer(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size is the most requests decoded at once (an integer of at least 1), "
                             f"got {max_batch_size!r}.")
        self.target, self.drafters, self.max_batch_size = target.eval(), drafters, int(max_batch_size)
        self.tokenizer = tokenizer  # for requests' stop strings
        self.route = isinstance(drafter, dict)
        if probe_rounds < 1:
            raise ValueError(f"probe_rounds must be at least 1, got {probe_rounds}.")
        if not 0.0 <= route_margin < 1.0:
            raise ValueError(f"route_margin must be in [0, 1), got {route_margin}.")
        self.probe_rounds, self.route_margin = probe_rounds, route_margin
        self.arm_evidence: dict[str, list] = {}  # arm -> [tokens, seconds, rounds] over every scored probe
        # arm -> [requests whose probes found it competitive, requests that probed it], for `_arms_to_probe`
        self.arm_record: dict[str, list[int]] = {}
        # Moving averages of a drafting call's seconds per drafter and of a whole step's, which price
        # a drafter that would draft for one row alone (`_split_threshold`).
        self.call_seconds: dict[str, float] = {}
        self.step_seconds: float | None = None
        # Per drafter, moving averages of its calls' steady seconds by the rows they drafted for,
        # which price a probe's drafting at the batch's size (`_probe_draft_seconds`).
        self.call_sizes: dict[str, dict[int, float]] = {}
        # A batch policy (`BatchDCutPolicy`) sizes each step's verify window across requests and
        # may skip drafting; without one every row's draft is verified whole.
        self.policy = policy
        # The latest step's batch, context and queue state, for policies whose `is_open` reprices
        # a closed drafter there (see `_arm_open`); None before the first step.
        self._conditions: dict | None = None
        is_open = getattr(policy, "is_open", None)
        self._policy_reprices = callable(is_open) and {"batch", "context", "queued"} <= set(
            inspect.signature(is_open).parameters)
        should_draft = getattr(policy, "should_draft", None)
        self._policy_prices_catch_up = (callable(should_draft)
                                        and "catch_up" in inspect.signature(should_draft).parameters)
        text = target.config.get_text_config()
        self.max_positions = getattr(text, "max_position_embeddings", None)
        self.final_state_index = text.num_hidden_layers  # hidden_states[L]: the final normed state
        self.layer_ids = sorted({i for model in drafters.values() for i in model.config.target_layer_ids})
        self.attention_windows = attention_windows(target)
        self.keeps_logits = "logits_to_keep" in inspect.signature(target.forward).parameters
        self._waiting: list[_Row] = []
        self._rows: list[_Row] = []
        # Cache rows of requests that finished while others waited, kept for the next step's joining
        # requests to take over (`_place_joined`); indices into ``_rows``, whose entries there are done.
        self._vacant: list[int] = []
        self._cache, self._valid = None, None
        self._start_session(None)

    # -- public ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether submitted requests are still waiting or being decoded (`step` has work to do)."""
        return bool(self._waiting or self._rows)

    def submit(self, prompt: list[int], max_new_tokens: int = 128, *, eos_token_id: int | list[int] | None = None,
               do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, domain: str | None = None, stop_strings: str | list[str] | None = None) -> int:
        """Queue one request; its id, which `step`'s events carry. It joins the batch at the next
        step with a free slot, so requests can arrive while others are being decoded (continuous
        batching). Decoding settings are the request's own: greedy and sampled requests, with
        different temperatures, share a batch. ``eos_token_id`` None stops at the target's own
        (``generation_config.eos_token_id``), as ``target.generate`` does; ``[]`` decodes
        ``max_new_tokens`` whatever comes. ``stop_strings`` end the request where its text (prompt
        included) ends in one of them, the token that completes it kept: transformers' own matching
        (``StopStringCriteria``), so the output is ``target.generate(stop_strings=..., tokenizer=...)``'s;
        they need the engine's ``tokenizer``. Raises `EngineRequestError` for a prompt that cannot be
        served (not one sequence of int ids, empty, ids outside the vocabulary, too long for the
        target) or a bad ``max_new_tokens`` / ``eos_token_id``, and ``ValueError`` for a bad
        sampling setting; the requests already queued are not affected.
        """
        processors = self._processors(temperature, top_k, top_p) if do_sample else LogitsProcessorList()
        request = self._new_id()
        prompt, max_new_tokens = _token_ids(prompt, "A prompt"), _max_new_tokens(max_new_tokens)
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        eos = _eos_set(eos_token_id)
        stop = self._stop_criteria(stop_strings)
        error = self._validate(prompt, max_new_tokens)
        if error is not None:
            raise error
        self._waiting.append(_Row(request, prompt, len(prompt), max_new_tokens, domain,
                                  eos=eos, do_sample=do_sample, processors=processors, stop=stop))
        return request

    def _stop_criteria(self, stop_strings: str | list[str] | None) -> StopStringCriteria | None:
        if not stop_strings:
            return None
        if self.tokenizer is None:
            raise EngineRequestError("stop_strings are matched on the text: build the engine with "
                                     "SpeculativeEngine(..., tokenizer=tokenizer).")
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not all(isinstance(text, str) and text for text in strings):
            raise EngineRequestError(f"stop_strings must be non-empty strings, got {stop_strings!r}.")
        return StopStringCriteria(self.tokenizer, strings)

    @torch.no_grad()
    def step(self) -> list[EngineEvent]:
        """Admit waiting requests into free slots, run one verify forward for the batch, and report
        what each request gained: one event per request that committed tokens or finished."""
        if not self.has_work:
            return []
        joining = []
        while self._waiting and len(self._rows) - len(self._vacant) + len(joining) < self.max_batch_size:
            joining.append(self._waiting.pop(0))
        left = self._place_joined(self._prefill_parts(joining)) if joining else []
        self._drop_vacant()
        if left:
            batch = [(self._cache, self._valid)] if self._cache is not None else []
            self._cache, self._valid = self._merge(batch + [part for part, _ in left])
            self._rows += [row for _, members in left for row in members]
        rows = self._rows
        start = time.perf_counter()
        self._cache, self._valid = self._step(rows, self._cache, self._valid, queued=bool(self._waiting))
        self.step_seconds = moving_average(self.step_seconds, time.perf_counter() - start, TIMING_SMOOTHING)
        events = []
        finished = [i for i, row in enumerate(rows) if self._finished(row) and self._flushed(row)]
        for i, row in enumerate(rows):
            done = i in finished
            new = row.tokens[row.prompt_length + row.emitted:]
            row.emitted += len(new)
            if new or done:
                events.append(EngineEvent(row.index, new, done))
            if done:
                self._retire(row)
        if finished:
            self._vacant = finished
            if self._waiting and len(finished) < len(rows):
                # Requests wait: their prefilled caches take these rows over next step (`_place_joined`).
                self._valid[finished] = False
            else:
                self._drop_vacant()
        if self._rows:
            self._cache, self._valid = self._trim(self._cache, self._valid)
            self.peak_cache_length = max(self.peak_cache_length, self._valid.shape[1])
        return events

    def stream(self, prompts: list[list[int]], max_new_tokens: int = 128, eos_token_id: int | list[int] | None = None,
               do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, domains: list[str | None] | None = None,
               capture_layers: list[int] | None = None,
               stop_strings: str | list[str] | None = None) -> Iterator[EngineEvent]:
        """Serve ``prompts`` and yield every request's tokens as they are committed (`EngineEvent`:
        request = the prompt's index, the new tokens, whether it finished). A request that cannot be
        served yields one finished event with its ``error`` first; the others go on. Requests
        `submit`-ted while iterating join the batch and their events are yielded too. Starts a new
        session of the engine (request ids from 0, fresh ``stats``): it must be idle. See `generate`
        for ``domains`` and ``capture_layers``.
        """
        if self.has_work:
            raise RuntimeError("stream/generate start a new session, but submitted requests are still "
                               "being served: drain them with step() first.")
        prompts = list(prompts)
        if domains is not None and len(domains) != len(prompts):
            raise ValueError(f"domains names {len(domains)} requests for {len(prompts)} prompts.")
        self._check_capture_layers(capture_layers)
        self._start_session(capture_layers)
        settings = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=do_sample,
                        temperature=temperature, top_k=top_k, top_p=top_p, stop_strings=stop_strings)
        errors = []
        try:
            for index, prompt in enumerate(prompts):
                try:
                    self.submit(prompt, domain=domains[index] if domains is not None else None, **settings)
                except EngineRequestError as error:
                    errors.append(EngineEvent(index, [], True, error))
            yield from errors
            while self.has_work:
                yield from self.step()
        finally:
            # A caller that stops iterating (or an error) leaves no requests behind to block the next session.
            self.cancel()

    def cancel(self) -> None:
        """Drop every waiting and active request (their outputs so far stay in the events already
        yielded), leaving the engine idle for a new session."""
        self._waiting, self._rows, self._vacant = [], [], []
        self._cache, self._valid = None, None

    def _check_capture_layers(self, capture_layers: list[int] | None) -> None:
        layers = self.target.config.get_text_config().num_hidden_layers
        bad = [i for i in capture_layers or [] if not _is_integer(i) or not 0 <= i < layers]
        if bad:
            raise ValueError(f"capture_layers are decoder-layer indices 0..{layers - 1} (the drafters' "
                             f"target_layer_ids convention), got {bad}.")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, eos_token_id: int | list[int] | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, domains: list[str | None] | None = None,
                 capture_layers: list[int] | None = None,
                 stop_strings: str | list[str] | None = None) -> list[list[int] | EngineRequestError]:
        """Continue every prompt (greedy, or sampled); a request that cannot be served gets its error instead.
        Stops each at ``eos_token_id`` (None: the target's own, as ``target.generate``; ``[]``: none)
        and after any of ``stop_strings`` (see `submit`).

        ``domains`` names, per request, the drafter to use (with a ``{name: drafter}`` engine);
        requests without a known one are routed online. ``capture_layers`` (decoder-layer indices,
        the drafters' ``target_layer_ids`` convention) keeps the target's states of every token of
        every output while decoding: ``self.captured_states[request] = (features, final)`` with
        features ``(len(capture_layers), n, H)`` and the final normed hidden state ``(n, H)`` for
        all ``n`` output tokens, which is what a drafter's training reads (see `FeatureCache`),
        without a second pass over the text. A finished row stays for one more forward so its last
        token's states are computed as well.
        """
        prompts = list(prompts)
        results: list = []
        for prompt in prompts:
            try:
                results.append(_token_ids(prompt, "A prompt"))
            except EngineRequestError:
                results.append([])  # its error event replaces it
        for event in self.stream(prompts, max_new_tokens, eos_token_id, do_sample, temperature, top_k, top_p,
                                 domains, capture_layers, stop_strings):
            if event.error is not None:
                results[event.request] = event.error
            else:
                results[event.request] += event.tokens
        return results

    # -- internals --------------------------------------------------------------------------

    def _start_session(self, capture_layers: list[int] | None) -> None:
        """Fresh request ids, ``stats`` and captured states; the hidden states every forward returns."""
        self.capture_layers = list(capture_layers) if capture_layers is not None else None
        self.captured_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        wanted = {i + 1 for i in self.layer_ids}
        if self.capture_layers is not None:
            wanted |= {i + 1 for i in self.capture_layers} | {self.final_state_index}
        self.state_indices = sorted(wanted) or None
        self.stats: list[dict] = []
        self.peak_cache_length = 0
        self._next_id = 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _retire(self, row: _Row) -> None:
        """Keep a finished request's statistics (and captured states)."""
        if self.capture_layers is not None:
            self.captured_states[row.index] = self._gather_captured(row)
        self.stats.append({"index": row.index, "rounds": len(row.accepted), "accepted": row.accepted,
                           "drafter": row.arm, "switches": row.switches,
                           "probes": {arm: tuple(score) for arm, score in row.arm_scores.items()}})

    @staticmethod
    def _processors(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
        if temperature <= 0:
            raise ValueError("temperature must be > 0 when sampling; use do_sample=False for greedy decoding.")
        processors = LogitsProcessorList()
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        return processors

    @staticmethod
    def _choose(row: _Row, ids: list[int], logits: torch.Tensor) -> int:
        """The target's token from one position's raw logits: argmax, or a sample of the processed ones."""
        if not row.do_sample:
            return int(logits.argmax())
        processed = row.processors(torch.tensor([ids], device=logits.device), logits[None].float())
        return int(sample_tokens(processed.softmax(-1)))

    def _accept(self, row: _Row, draft: list[int], logits: torch.Tensor) -> list[int]:
        """Tokens a row gains from its window's target logits: accepted drafts plus one target token."""
        if not row.do_sample:
            accepted = 0
            while accepted < len(draft) and draft[accepted] == int(logits[accepted].argmax()):
                accepted += 1
            return draft[:accepted] + [int(logits[accepted].argmax())]
        ids = list(row.tokens)
        for j, token in enumerate(draft):
            p = row.processors(torch.tensor([ids], device=logits.device), logits[j][None].float()).softmax(-1)[0]
            q = row.draft_logits[0, j].float().softmax(-1).to(p.device)
            if torch.rand(()) > min(1.0, float(p[token] / q[token])):
                residual = (p - q).clamp_min(0)
                if float(residual.sum()) <= 0:
                    residual = p
                return draft[:j] + [int(sample_tokens(residual[None]))]
            ids.append(token)
        return draft + [self._choose(row, ids, logits[len(draft)])]

    def _validate(self, prompt, max_new_tokens) -> EngineRequestError | None:
        vocab = self.target.config.get_text_config().vocab_size
        if len(prompt) == 0:
            return EngineRequestError("Empty prompt: give at least one token id.")
        if any(not 0 <= int(t) < vocab for t in prompt):
            return EngineRequestError(f"Prompt has token ids outside the vocabulary 0..{vocab - 1}.")
        if self.max_positions and len(prompt) + max_new_tokens > self.max_positions:
            return EngineRequestError(
                f"Prompt of {len(prompt)} tokens plus {max_new_tokens} new ones exceeds the target's "
                f"{self.max_positions} positions: shorten the prompt or lower max_new_tokens."
            )
        return None

    @staticmethod
    def _finished(row: _Row) -> bool:
        return row.new_tokens >= row.max_new_tokens or row.stopped or (row.new_tokens > 0 and row.tokens[-1] in row.eos)

    def _flushed(self, row: _Row) -> bool:
        return self.capture_layers is None or row.flushed

    def _forward(self, input_ids, cache_valid, window_valid, position_ids, cache, logits_to_keep: int | None = None):
        """The target's forward over a window of ``input_ids`` (``window_valid``: its real slots) at
        ``position_ids``, after the cache columns ``cache_valid`` marks as committed; with
        ``logits_to_keep`` (only for targets that take it, `keeps_logits`), the logits of that many
        last positions only."""
        mask = torch.cat([cache_valid, window_valid], dim=1)
        if self.attention_windows is not None:
            mask = self._position_masks(mask, torch.cat([cache_valid.long().cumsum(1) - 1, position_ids], dim=1),
                                        position_ids)
        else:
            mask = mask.long()
        extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        return self.target(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=True, output_hidden_states=self.state_indices, **extra)

    def _position_masks(self, key_valid: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor):
        """4D masks by layer type (one tensor when all layers share a type) in which each query sees
        its own row's committed keys at positions at most its own and, in sliding layers, fewer than
        the window behind it: what plain decoding of that row sees."""
        implementation = self.target.config._attn_implementation
        if implementation not in ("eager", "sdpa", ATTENTION_NAME):
            raise UnsupportedCacheError(
                f"SpeculativeEngine builds the sliding-window masks of {self.target.config.model_type} itself, which "
                f"attn_implementation={implementation!r} does not take; load the target with "
                "attn_implementation='sdpa' (or 'eager')."
            )
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        seen = key_valid[:, None, :] & (distance >= 0)
        masks = {}
        for layer_type, window in self.attention_windows.items():
            mask = (seen if window is None else seen & (distance < window))[:, None]
            if implementation == "eager":
                mask = torch.zeros(mask.shape, dtype=self.target.dtype, device=mask.device).masked_fill_(
                    ~mask, torch.finfo(self.target.dtype).min)
            masks[layer_type] = mask
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def _capture(self, row: _Row, out, index: int, count: int) -> None:
        """Keep the states of the ``count`` leading window positions of batch row ``index``."""
        if self.capture_layers is None or count <= 0:
            return
        states = out.hidden_states
        features = torch.stack([states[i + 1][index, :count] for i in self.capture_layers])
        final = states[self.final_state_index][index, :count]
        row.captured.append((features, final))

    @staticmethod
    def _gather_captured(row: _Row) -> tuple[torch.Tensor, torch.Tensor]:
        features, final = zip(*row.captured)
        row.captured = []
        return torch.cat(features, dim=1), torch.cat(final, dim=0)

    def _row_outputs(self, out, row: int, committed: int):
        """The hidden states of one row's ``committed`` leading window positions, in tensors of their own.

        Copied rather than sliced: a routed request's backlog can wait many rounds for its arm to
        draft, and a view would keep every verify forward's whole-batch states alive that long."""
        if not self.layer_ids:
            return None
        return tuple(h[row : row + 1, :committed].clone() if h is not None else None for h in out.hidden_states)

    @staticmethod
    def _queue_outputs(row: _Row, outputs) -> None:
        """Hold one forward's committed states of a row for each of its candidate drafters."""
        for arm in row.generators:
            row.pending.setdefault(arm, []).append(outputs)

    @staticmethod
    def _take_pending(row: _Row, arm: str) -> tuple[SimpleNamespace, float]:
        """Every position ``arm``'s drafter has not ingested, as one forward's outputs, and the
        share of them the latest verify forward committed (the rest is catch-up, the prompt's
        states included: reading a request's prompt is paid once, not by every drafting round).

        Why the prompt counts as catch-up: drafting time feeds each drafter's gate, and the first
        round of a batch of new requests, whose drafter read four prompts, took 37 ms against about
        10 ms for the rounds after it; measured as a round, it put DFlash-Block8's efficiency at 0.97
        (the plain mean of the rounds so far is that one round) and closed its gate for the next 16
        steps (reference target, concurrency 4, the router over the three shipped drafters)."""
        pending = row.pending.pop(arm, [])
        first = row.generators[arm].committed == 0  # the first entry is the prompt's prefill
        if len(pending) <= 1:
            return SimpleNamespace(hidden_states=pending[0] if pending else None), 0.0 if first else 1.0
        layers = list(zip(*pending))
        lengths = [part.shape[1] for part in next(parts for parts in layers if parts[0] is not None)]
        merged = tuple(None if parts[0] is None else torch.cat(parts, dim=1) for parts in layers)
        return SimpleNamespace(hidden_states=merged), lengths[-1] / sum(lengths)

    def _prefill_parts(self, joining: list[_Row]) -> list[tuple[tuple[BufferedCache, torch.Tensor], list[_Row]]]:
        """Prefill the joining prompts, in groups of similar length (`prefill_groups`), each in a cache
        of its own, and take their first tokens: (the group's cache and valid columns, its rows)."""
        parts = []
        for group in prefill_groups([row.prompt_length for row in joining]):
            members = [joining[i] for i in group]
            parts.append((self._prefill(members), members))
        return parts

    def _place_joined(self, parts):
        """Write the prefilled groups that fit into the rows of requests that finished last step
        (`_vacant`): a group fits when enough such rows are left and its prompts are no wider than
        the batch's cache. The groups that did not fit are returned, to be merged (`_merge`).

        Why: each merge and each drop of finished rows copies every row's cache, and with a drafter
        rows that joined together finish on different steps, one at a time. At concurrency 16 on the
        reference CPU (an Intel Xeon with AMX, cProfile of one pass each) DFlash-Block8 + D-cut's
        engine merged 14 times and dropped rows 27 times against plain decoding's 7 and 14: 2.9 s of
        copies against 1.5 s in a 37 s pass (`logs/s59/profile_c16.py`). Placed instead, paired with
        plain batched decoding (which places too): 0.949x / 0.962x against 0.887x / 0.939x."""
        left = []
        for (cache, valid), members in parts:
            if len(members) > len(self._vacant) or self._cache is None or valid.shape[1] > self._valid.shape[1]:
                left.append(((cache, valid), members))
                continue
            slots, self._vacant = self._vacant[: len(members)], self._vacant[len(members):]
            length = self._valid.shape[1]
            for index, layer in enumerate(self._cache.layers):
                for part_row, slot in enumerate(slots):
                    layer.place(slot, cache.layers[index], part_row)
            for part_row, (slot, row) in enumerate(zip(slots, members)):
                self._valid[slot] = _pad_left(valid[part_row : part_row + 1], length, 1, False)[0]
                self._rows[slot] = row
        return left

    def _drop_vacant(self) -> None:
        """Drop the finished requests' rows no joining request took over."""
        if not self._vacant:
            return
        vacant, self._vacant = set(self._vacant), []
        keep = [i for i in range(len(self._rows)) if i not in vacant]
        self._rows = [self._rows[i] for i in keep]
        if self._rows:
            self._cache.batch_select_indices(torch.tensor(keep, device=self._valid.device))
            self._valid = self._valid[keep]
        else:
            self._cache, self._valid = None, None

    def _prefill(self, joining: list[_Row]):
        """One forward over the prompts of ``joining``, right-padded to the longest; the new cache and
        its valid columns."""
        width = max(row.prompt_length for row in joining)
        device = self.target.device
        ids = torch.zeros(len(joining), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(joining), width, dtype=torch.bool, device=device)
        for i, row in enumerate(joining):
            ids[i, : row.prompt_length] = torch.tensor(row.tokens, device=device)
            mask[i, : row.prompt_length] = True
        positions = torch.arange(width, device=device)[None].expand(len(joining), -1)
        # Only the last prompt token's logits are used; the lm_head over every prompt position was a
        # fifth of a prefill's time (reference target, 2 threads, 64-320 tokens a prompt).
        keep = width - min(row.prompt_length for row in joining) + 1 if self.keeps_logits else None
        skipped = width - (keep or width)  # leading positions without logits
        # Layers that keep every column, sliding-window ones too (see `attention_windows`, which refuses
        # every other layer type), so that rows can be merged and dead columns trimmed.
        new_cache = BufferedCache()
        out = self._forward(ids, mask[:, :0], mask, positions, new_cache, logits_to_keep=keep)
        for i, row in enumerate(joining):
            row.tokens += _until_stop(row, [self._choose(row, row.tokens, out.logits[i, row.prompt_length - 1 - skipped])])
            self._assign_drafters(row)
            self._queue_outputs(row, self._row_outputs(out, i, row.prompt_length))
            self._capture(row, out, i, row.prompt_length)
        return new_cache, mask

    @staticmethod
    def _merge(parts: list[tuple[BufferedCache, torch.Tensor]]) -> tuple[BufferedCache, torch.Tensor]:
        """Caches and their valid columns stacked row-wise in the given order (the first cache, its
        layers replaced), each left-padded to the longest with invalid columns."""
        cache = parts[0][0]
        if len(parts) == 1:
            return parts[0]
        length = max(valid.shape[1] for _, valid in parts)
        for index, layer in enumerate(cache.layers):
            layer.stack([part.layers[index] for part, _ in parts], length)
        return cache, torch.cat([_pad_left(valid, length, 1, False) for _, valid in parts])

    @staticmethod
    def _trim(cache, valid):
        """Drop cache columns no row attends to: before the oldest remaining row's first token (rows
        that left) and after the last accepted slot of the latest window (drafts every row rejected).

        A view of the layers' buffers (`BufferedLayer.keep_columns`), so this costs nothing, while
        without it the cache grows by the whole window every step and every later forward attends
        over the dead columns.
        """
        used = valid.any(0).nonzero()
        first, last = int(used[0]), int(used[-1]) + 1
        if first == 0 and last == valid.shape[1]:
            return cache, valid
        for layer in cache.layers:
            layer.keep_columns(first, last)
        return cache, valid[:, first:last]

    def _new_generator(self, row: _Row, drafter):
        config = GenerationConfig(max_length=row.prompt_length + row.max_new_tokens, do_sample=row.do_sample)
        generator = drafter.get_candidate_generator(target=self.target, generation_config=config,
                                                    logits_processor=row.processors)
        generator.update_candidate_strategy(None, None, 0)  # the prefill round
        if self.policy is not None:
            # The batch policy cuts; the row's generator only reports its confidences.
            generator.policy = FixedLengthPolicy()
        return generator

    def _assign_drafters(self, row: _Row) -> None:
        """The drafter a request uses: its domain's, the only one, or every one (to be routed)."""
        if not self.drafters:
            return
        if not self.route:
            row.arm = next(iter(self.drafters))
        elif row.domain in self.drafters:
            row.arm = row.domain
        else:
            row.probing = self._arms_to_probe()
            row.arm = self._live_arm(row.probing)
            row.generators = {name: self._new_generator(row, model) for name, model in self.drafters.items()}
            return
        row.generators = {row.arm: self._new_generator(row, self.drafters[row.arm])}

    @property
    def _arms(self) -> list[str]:
        """What a routed request chooses between: every drafter and "no drafter"."""
        return [*self.drafters, NO_DRAFTER]

    def _pooled_rate(self, arm: str) -> float | None:
        """Tokens per second of ``arm`` over every routed round so far, once it has enough of them
        (``4 * probe_rounds``) to judge it by."""
        tokens, seconds, rounds = self.arm_evidence.get(arm, (0, 0.0, 0))
        return tokens / seconds if rounds >= 4 * self.probe_rounds and seconds > 0 else None

    def _arms_to_probe(self) -> list[str]:
        """Every arm but those that, over at least `PRUNE_AFTER_REQUESTS` requests that probed
        them, were competitive (see `_record_competition`) in none: arms without a pooled rate
        first, then the others from the best pooled rate down.

        Why not the pooled rates themselves: they mix the workload's domains. Served in domain
        order, the chat requests' probes put DFly-Block8 at half DFlash's pooled rate, and the code
        and math requests after them never probed the drafter made for them (concurrency 4 on the
        reference target, 12 mixed prompts)."""
        arms = [arm for arm in self._arms if not self._outclassed(arm)]
        rates = {arm: self._pooled_rate(arm) for arm in arms}
        unknown = [arm for arm in arms if rates[arm] is None]
        return unknown + sorted((arm for arm in arms if rates[arm] is not None), key=lambda arm: -rates[arm])

    def _outclassed(self, arm: str) -> bool:
        competitive, probed = self.arm_record.get(arm, (0, 0))
        return probed >= PRUNE_AFTER_REQUESTS and competitive == 0

    @staticmethod
    def _own_rates(row: _Row) -> dict[str, float]:
        """Tokens per second of every arm by the request's own scored probes."""
        return {arm: tokens / seconds for arm, (tokens, seconds, _) in row.arm_scores.items() if seconds > 0}

    def _record_competition(self, row: _Row) -> None:
        """Count, for every arm a request probed, whether its own rate came within ``route_margin``
        of the request's best arm's."""
        rates = self._own_rates(row)
        best = max(rates.values(), default=0.0)
        for arm, rate in rates.items():
            record = self.arm_record.setdefault(arm, [0, 0])
            record[0] += rate >= (1.0 - self.route_margin) * best
            record[1] += 1

    def _live_arm(self, probing: list[str]) -> str:
        """The arm verified while a request probes: the best pooled one, or the first drafter
        before there is evidence (a shadow arm costs its drafting either way); but the drafter the
        batch's rows draft with while the pooled evidence does not put the best one more than
        `MIGRATE_MARGIN` ahead of it (`_own_drafter_pays`, as a request settling would).

        Why: with probes priced at the batch's size (`_probe_draft_seconds`), two drafters a few
        percent apart trade the lead in the pooled rates from request to request, and a request
        verified with the other one splits the batch's drafting into two calls a step while it
        probes, then settles with the rows it joined: at concurrency 4 on the reference CPU the
        requests of a pass settled on DFlash-Block8 and DFly-Block8 by turns (6 and 10 of 16), the
        batch's drafter changing with them (`logs/s59/router_trace.py`)."""
        rates = {arm: self._pooled_rate(arm) for arm in probing}
        known = [arm for arm in probing if rates[arm] is not None]
        if not known:
            return next((arm for arm in probing if arm != NO_DRAFTER), NO_DRAFTER)
        in_use = self._arms_in_use(None)
        return self._best_unless_shared_pays_more(
            {arm: rates[arm] for arm in known}, [arm for arm in known if arm in in_use and self._arm_open(arm)])

    @staticmethod
    def _probes_drafted(row: _Row, arm: str) -> int:
        """Probes of ``arm`` so far: the scored ones and those waiting for their text."""
        return row.arm_scores.get(arm, (0, 0.0, 0))[2] + sum(probe.arm == arm for probe in row.probes)

    def _wants_probe(self, row: _Row, arm: str) -> bool:
        return arm in row.probing and self._probes_drafted(row, arm) < self.probe_rounds

    def _shadow_arms(self, row: _Row) -> list[str]:
        """The drafters that draft for a row this round without being verified: while it probes,
        except while the policy has measured the row's verified drafter not paying (its retries
        then draft that drafter alone).

        Why: where the verified drafter does not pay, probes beside it multiply drafting that does
        not pay either. On the reference CPU at concurrency 16 (12 mixed requests) the retries of
        the closed gate drafted with all three drafters, 114-126 ms against 80 ms for a plain step.
        An unmeasured drafter is not held back: waiting for it to be measured paying cost the
        router 5% at concurrency 4, where requests then settled on the first drafter that paid."""
        if row.arm != NO_DRAFTER and not self._arm_open(row.arm):
            return []
        return [arm for arm in row.probing if arm not in (row.arm, NO_DRAFTER) and self._wants_probe(row, arm)]

    def _probe_draft_seconds(self, arm: str, batch: int, measured: float) -> float:
        """What a probe of ``arm`` costs in drafting: its share of a call drafting for the whole
        ``batch`` (`call_seconds_at`), else the ``measured`` share of the call it was drafted in.

        Why: a probe asks how well a drafter would serve the request were the batch drafting with
        it; what drafting for the request alone adds is priced apart (`_split_threshold`). Priced
        as measured, a shadow probe drafted for one or two rows paid its call's fixed cost alone
        while the verified drafter's was shared by the batch, so the drafter a request was verified
        with won its probes and, through them, the pooled evidence: at concurrency 4 on the
        reference CPU (an Intel Xeon with AMX), between DFlash-Block8 and DFly-Block8, in 18 of the
        24 code and math requests of two passes; priced this way, in 5 of 12
        (`logs/s59/router_trace.py`)."""
        at_batch = call_seconds_at(self.call_sizes.get(arm, {}), batch)
        return measured if at_batch is None else at_batch / max(batch, 1)

    def _add_probe(self, row: _Row, arm: str, draft: list[int], seconds: float) -> None:
        row.probes.append(_Probe(arm, len(row.tokens), draft, seconds))

    def _score_probes(self, row: _Row, ended: bool) -> None:
        """Score the probes whose drafted positions the request has now committed (all of them once
        it ended): tokens gained = drafts matching the committed text, plus the target's own token;
        then settle the request if every arm has been probed enough."""
        waiting = []
        for probe in row.probes:
            committed = row.tokens[probe.start:]
            matched = 0
            while matched < min(len(probe.tokens), len(committed)) and probe.tokens[matched] == committed[matched]:
                matched += 1
            if matched == len(probe.tokens) or matched < len(committed) or ended:
                seconds = probe.draft_seconds + (probe.verify_seconds or 0.0)
                self._add_round(row.arm_scores, probe.arm, matched + 1, seconds)
                self._add_round(self.arm_evidence, probe.arm, matched + 1, seconds)
            else:
                waiting.append(probe)
        row.probes = waiting
        if not ended:
            self._settle_if_probed(row)

    def _settle_if_probed(self, row: _Row) -> None:
        """Settle a probing request once every arm it probes has its probes drafted and scored."""
        if row.probing and not row.probes and all(
                self._probes_drafted(row, arm) >= self.probe_rounds for arm in row.probing):
            self._settle(row)

    def _blended_rate(self, row: _Row, arm: str) -> float:
        """The request's own probes of ``arm`` plus the pooled evidence, weighted as ``probe_rounds`` rounds."""
        tokens, seconds, _ = row.arm_scores.get(arm, (0, 0.0, 0))
        pooled_tokens, pooled_seconds, pooled_rounds = self.arm_evidence.get(arm, (0, 0.0, 0))
        if pooled_rounds:
            weight = self.probe_rounds / pooled_rounds
            tokens, seconds = tokens + weight * pooled_tokens, seconds + weight * pooled_seconds
        return tokens / max(seconds, 1e-9)

    @staticmethod
    def _add_round(scores: dict, arm: str, tokens: int, seconds: float) -> None:
        """Count one round of ``arm`` into an arm -> [tokens, seconds, rounds] table."""
        score = scores.setdefault(arm, [0, 0.0, 0])
        score[0], score[1], score[2] = score[0] + tokens, score[1] + seconds, score[2] + 1

    def _settle(self, row: _Row) -> None:
        """End a request's probes on the arm with the best blended rate among those it may settle
        on (`_settling_arms`); keep the other probed drafters idle where the policy can close its
        drafter (see `_leave_closed_drafter`), else drop them."""
        # Only arms with probes of its own: an arm's pooled rate says how it did on other requests'
        # text, and a code request once settled on MTP, never probed, on chat requests' evidence.
        if row.arm_scores:
            self._record_competition(row)
            row.arm = self._batch_choice(row, {arm: self._blended_rate(row, arm) for arm in self._settling_arms(row)})
            if self._reopened_by_probes(row):
                # Why: a drafter's gate is measured on whatever rows drafted with it, and closed on the
                # first requests' text it closed for every later one. Served in domain order, chat first,
                # at concurrency 4 on the reference CPU, DFlash-Block8's and DFly-Block8's gates closed
                # on the chat requests (efficiency 0.91 / 0.88) and every code and math request
                # settled on MTP-TTT3 (tau 1.5-2.2 where DFlash drafts about 2.9; 46 tokens/s against
                # DFlash + D-cut's 58; `logs/s55/router_c4_trace.py`).
                self.policy.reopen(row.arm)
        row.probing = []
        # The probed drafters stay, idle, for `_leave_closed_drafter`, where the policy can close one.
        keep = {row.arm} | (set(row.arm_scores) if row.arm != NO_DRAFTER and self._policy_gates_arms else set())
        self._keep_generators(row, keep)

    def _reopened_by_probes(self, row: _Row) -> bool:
        """Whether a request settled on a drafter the policy keeps closed while a drafter it probed is
        open: its own probes put that one far ahead (`_settling_arms`), and a policy that can
        ``reopen`` should measure it afresh."""
        return (row.arm != NO_DRAFTER and self._policy_reopens and not self._arm_open(row.arm)
                and any(arm != NO_DRAFTER and self._arm_open(arm) for arm in row.arm_scores))

    def _batch_choice(self, row: _Row, rates: dict[str, float]) -> str:
        """The arm with the best rate, unless it is a drafter none of the batch's other rows drafts
        with, while they draft with one the request also probed: then that one (the best of them),
        unless the split pays (`_split_threshold`) or the pooled evidence of every request puts the
        new drafter more than `MIGRATE_MARGIN` ahead of it (so that a batch on a worse drafter
        moves over as its requests turn over, instead of holding every newcomer).

        Why: a drafting call costs about the same for one row as for four, so a drafter serving one
        row adds its whole call to every step of the batch. At concurrency 4 on the reference CPU
        (the main job's 16 requests) requests settled on DFlash-Block8 and DFly-Block8 by a few
        percent either way; the batch then drafted with both in most steps (350 drafting calls
        against 206 for DFlash alone, 1-3 rows each), 6.2 s of drafting a pass against 3.2 s,
        which was the router's whole gap to DFlash + D-cut (38.1 s against 35.0 s, the same
        number of steps; `logs/s48/router_trace.py`)."""
        in_use = self._arms_in_use(row)
        return self._best_unless_shared_pays_more(rates, [arm for arm in rates if arm in in_use])

    def _best_unless_shared_pays_more(self, rates: dict[str, float], shared: list[str]) -> str:
        """The arm with the best rate, unless it is a drafter outside ``shared`` (drafters the
        batch's other rows draft with): then the best of ``shared``, unless drafting the best one
        beside them pays (`_own_drafter_pays`). "No drafter" adds no call, so it is never held back."""
        best = max(rates, key=lambda arm: rates[arm])
        if best == NO_DRAFTER or best in shared or not shared:
            return best
        partner = max(shared, key=lambda arm: rates[arm])
        return best if self._own_drafter_pays(best, partner, [rates[best] / max(rates[partner], 1e-9)]) else partner

    def _own_drafter_pays(self, arm: str, shared: str, ratios: list[float]) -> bool:
        """Whether requests whose rates on ``arm`` are ``ratios`` times their rates on ``shared`` (a
        drafter the batch's other rows draft with) should draft with ``arm`` on their own: the split
        pays (`_split_threshold`), or the pooled evidence of every request puts ``arm`` more than
        `MIGRATE_MARGIN` ahead of ``shared`` (so that a batch on a worse drafter moves over)."""
        pooled_own, pooled_shared = self._pooled_rate(arm), self._pooled_rate(shared)
        if pooled_own is not None and pooled_shared is not None and pooled_own > (1 + MIGRATE_MARGIN) * pooled_shared:
            return True
        return sum(ratios) / len(ratios) > self._split_threshold(arm, len(ratios))

    def _arms_in_use(self, row: _Row | None) -> set[str]:
        """The drafters the batch's other active rows (all of them for None) are verified with."""
        return {other.arm for other in self._rows
                if other is not row and other.generator is not None and not self._finished(other)}

    def _split_threshold(self, arm: str, rows: int = 1) -> float:
        """How many times their rates on the batch's drafter ``rows`` requests' rates on ``arm``
        must be (on average) for drafting ``arm`` for them alone to pay: ``1 + B * call / (step *
        rows)`` for a batch of B rows, ``call`` seconds for a drafting call of ``arm`` less catch-up
        (`steady_call_seconds`) and ``step`` seconds a step (moving averages).

        Why that: with the other rows gaining about as many tokens a step as these would on the
        shared drafter (t), the batch gains ``(B - rows) t + sum of rate ratios * t`` tokens in
        ``step + call`` seconds against ``B t`` in ``step``; the first is larger exactly when the
        mean ratio exceeds the threshold. Before any step or call of ``arm`` was timed: 1."""
        call = self.call_seconds.get(arm)
        if call is None or not self.step_seconds:
            return 1.0
        batch = sum(not self._finished(other) for other in self._rows)
        return 1.0 + max(batch, 1) * call / (self.step_seconds * max(rows, 1))

    @property
    def _policy_reopens(self) -> bool:
        return callable(getattr(self.policy, "reopen", None))

    def _arm_measured(self, arm: str) -> bool:
        """Whether the policy has measured drafter ``arm`` (a policy without ``measured`` counts every
        drafter as measured)."""
        measured = getattr(self.policy, "measured", None)
        return measured(arm) if callable(measured) else True

    @property
    def _policy_gates_arms(self) -> bool:
        return callable(getattr(self.policy, "is_open", None))

    def _arm_open(self, arm: str) -> bool:
        """Whether the policy lets drafter ``arm`` draft (a policy without ``is_open`` always does),
        at this step's conditions where the policy takes them (`BatchDCutPolicy.is_open`)."""
        if not self._policy_gates_arms:
            return True
        if self._conditions is not None and self._policy_reprices:
            return self.policy.is_open(arm, **self._conditions)
        return self.policy.is_open(arm)

    @staticmethod
    def _keep_generators(row: _Row, arms: set) -> None:
        row.generators = {arm: generator for arm, generator in row.generators.items() if arm in arms}
        row.pending = {arm: states for arm, states in row.pending.items() if arm in row.generators}

    def _leave_closed_drafter(self, row: _Row) -> None:
        """Move a request off a drafter the policy has closed, to the best open drafter it may use:
        while it probes, the open probed drafter with the best pooled rate becomes the one verified;
        once settled, the open drafter it probed best. Its other drafters stay, idle, so that it can
        move again if that one closes too (``switches`` in its stats counts the moves).

        Why: rows on a closed drafter decode plainly, and a drafter serving one row of a batch pays
        its call's whole fixed cost alone (DFlash-Block8 drafting for 1 row took 8 ms against 13.5
        ms for 4 on the reference CPU), so its gate closes where the same row would pay on the
        batch's other drafter. At concurrency 4 on the main job's 16 requests (`logs/s47`), one
        request a pass then decoded plainly for 46-48 rounds: a chat request that had already
        moved once (the rule allowed one move) and a code request still probing, whose probes wait
        for a drafting round that never came; each pass needed 772-810 request-rounds against
        DFlash + D-cut's 762-767. A request also settles before the policy has measured most
        drafters (when its probes are scored), so the drafter it settled on can close later."""
        if row.arm == NO_DRAFTER or len(row.generators) < 2 or self._arm_open(row.arm):
            return
        usable = [arm for arm in row.probing if arm in row.generators] if row.probing else list(row.generators)
        # A settled request moves only to a drafter measured paying. Why: its drafter closed on its
        # own rows' text, and an unmeasured one is open only for want of evidence. At concurrency 4
        # on the reference CPU, requests moved off a drafter whose gate closed on their chat text to
        # MTP-TTT3 while it was unmeasured (5-6 moves a pass; 2-4 with this rule), adding its
        # drafting call to the batch's steps where decoding plainly paid as well (the router over the
        # three drafters 1.153x-1.218x of plain batched decoding against 1.246x-1.306x over the two
        # block drafters, four paired reps; `logs/s56/c4_configs.py`); with this rule 1.226x-1.247x
        # against 1.181x-1.196x before, three paired reps (`logs/s56/measured_ab.py`). A probing
        # request still moves to any open drafter: its probes wait for a drafting round.
        open_arms = [arm for arm in sorted(usable) if arm != row.arm and self._arm_open(arm)
                     and (row.probing or self._arm_measured(arm))]
        if not open_arms:
            return
        if row.probing:
            row.arm = max(open_arms, key=lambda arm: self._pooled_rate(arm) or 0.0)
        else:
            row.arm = max(open_arms, key=lambda arm: self._blended_rate(row, arm))
        row.switches += 1

    def _consolidate(self, rows: list[_Row]) -> None:
        """Move the settled requests of a drafter only they draft with onto a drafter the batch's
        other requests draft with, once sharing its call pays more than keeping their own: the
        rule `_batch_choice` applies when a request settles (`_own_drafter_pays`), applied again to
        the group as the batch around it changes. The smallest group moves first, only to an open
        drafter the policy has measured that each of its requests probed (and keeps, idle), and
        not while a probing request is verified with the group's drafter (its call stays).

        Why: a request settles against the drafters in use at that moment. Served in domain order,
        the first (chat) requests settled on MTP-TTT3 together, where it was the batch's drafter,
        and kept drafting with it beside the code requests' DFlash-Block8 until they ended: 208-366
        request-rounds a pass, a second drafting call in 83-111 steps at concurrency 4 on the
        reference CPU, where MTP's gate stood at 0.98-1.01 (`logs/s58/router_account.py`)."""
        groups: dict[str, list[_Row]] = {}
        for row in rows:
            if not self._finished(row) and row.generator is not None:  # "no drafter" has no generator
                groups.setdefault(row.arm, []).append(row)
        for arm in sorted(groups, key=lambda name: (len(groups[name]), name)):
            group = groups[arm]
            if not group or any(row.probing for row in group):
                continue
            others = [name for name in groups if name != arm and groups[name]
                      and self._arm_open(name) and self._arm_measured(name)
                      and all(name in row.generators for row in group)]
            if not others:
                continue
            rates = {name: [self._blended_rate(row, name) for row in group] for name in [arm, *others]}
            shared = max(others, key=lambda name: sum(rates[name]))
            ratios = [own / max(there, 1e-9) for own, there in zip(rates[arm], rates[shared])]
            if self._own_drafter_pays(arm, shared, ratios):
                continue
            for row in group:
                row.arm = shared
                row.switches += 1
            groups[shared] = groups[shared] + group
            groups[arm] = []

    def _stop_probing_closed(self, row: _Row) -> None:
        """Stop probing the drafters the policy keeps closed while another probed drafter is open,
        once the request has drafted its probes of them (only its own probes can settle it on
        one, see `_settling_arms`), and settle the request if the arms left have been probed enough.

        Why: their shadow drafts bought nothing and cost a drafting call each. At concurrency 4 on
        the reference CPU MTP-TTT3's gate closes (its drafting does not pay there), yet every later
        request still drafted it beside its verified drafter: probe steps took 44 ms against 17 ms
        for DFly-Block8 alone with 4 rows, 0.7 s of a 30 s pass (`logs/s47/router_trace.py`)."""
        open_arms = self._without_closed_drafters(row.probing)
        kept = [arm for arm in row.probing if arm in open_arms or self._wants_probe(row, arm)]
        if kept != row.probing:
            row.probing = kept
            self._settle_if_probed(row)

    def _settling_arms(self, row: _Row) -> list[str]:
        """The arms a request may settle on: those it probed, less the drafters the policy keeps
        closed while another probed drafter is open, unless the request's own probes put one at
        `REOPEN_FACTOR` times the best open drafter's rate (`_settle` then has the policy measure it
        afresh, `reopen`).

        Why: rows on a closed drafter decode plainly. The MTP drafter's gate closes at concurrency
        4 on the reference CPU (its drafting does not pay there), and requests whose two probes put
        it ahead by a hair, chat and code, ran at tau 1.07 for 76-119 rounds beside DFlash rows at
        2.0-2.5. With every drafter closed none is left out, so that a gate hovering near 1 does not
        send every request to "no drafter"."""
        probed = sorted(row.arm_scores)
        kept = self._without_closed_drafters(probed)
        rates = self._own_rates(row)
        best_open = max((rates.get(arm, 0.0) for arm in kept if arm != NO_DRAFTER), default=0.0)
        if not self._policy_reopens or best_open <= 0.0:
            return kept
        return [arm for arm in probed if arm in kept or rates.get(arm, 0.0) >= REOPEN_FACTOR * best_open]

    def _without_closed_drafters(self, arms: list[str]) -> list[str]:
        """``arms`` less the drafters the policy keeps closed, unless none of its drafters is open
        (then all of them, in order)."""
        if not any(arm != NO_DRAFTER and self._arm_open(arm) for arm in arms):
            return arms
        return [arm for arm in arms if arm == NO_DRAFTER or self._arm_open(arm)]

    def _policy_drafts(self, rows: list[_Row], active: list[bool], arm: str) -> bool:
        """Whether the policy lets ``arm``'s rows draft this step (`_conditions`), told what its
        drafter has yet to read for them where the policy takes ``catch_up``."""
        conditions = self._conditions["batch"], self._conditions["context"], self._conditions["queued"]
        if self._policy_prices_catch_up:
            return self.policy.should_draft(*conditions, arm=arm, catch_up=self._catch_up(rows, active, arm))
        return self.policy.should_draft(*conditions, arm=arm)

    def _catch_up(self, rows: list[_Row], active: list[bool], arm: str) -> int:
        """Decoded positions that drafting ``arm``'s rows this step has its drafter, and the drafters
        of the probes beside it (`_shadow_arms`), read first: those each has not read. Prompts are
        left out: reading a prompt is what drafting a request costs at all, whenever it starts
        (`BatchDCutPolicy.should_draft`).

        Why the probes' drafters too: they read only when the row's drafter drafts, and a routed
        batch's first step at concurrency 16 read with all three (reference target: 8 rows, 1548
        positions each, 507 ms against a plain step's 106; `logs/s62/router_c16.py`)."""
        missed = 0
        for row, is_active in zip(rows, active):
            if is_active and row.arm == arm:
                for reader in {arm, *self._shadow_arms(row)} & set(row.generators):
                    missed += len(row.tokens) - 1 - max(row.generators[reader].committed, row.prompt_length)
        return missed

    def _draft(self, rows: list[_Row], active: list[bool], batch: int) -> list[list[int]]:
        """Every active row's draft, and the shadow drafts of probing rows: each drafter ingests the
        new states of all its rows, then drafts for all of them, in batched calls (`observe_many`,
        `propose_many`), their time shared evenly; ``batch``: the step's unfinished rows, at whose
        size probes are priced (`_probe_draft_seconds`)."""
        # (arm, decoding) -> (row, verified?) of the rows it drafts for: a batched draft picks every
        # row's tokens one way, so greedy and sampled rows (or rows with and without warpers) draft apart.
        groups: dict[tuple[str, bool, bool], list[tuple[int, bool]]] = {}
        for i, (row, is_active) in enumerate(zip(rows, active)):
            if not is_active:
                continue
            decoding = (row.do_sample, len(row.processors) > 0)
            if row.generator is not None:
                groups.setdefault((row.arm, *decoding), []).append((i, True))
            for arm in self._shadow_arms(row):
                groups.setdefault((arm, *decoding), []).append((i, False))
        drafts: list[list[int]] = [[] for _ in rows]
        for (arm, *_), members in groups.items():
            ids = [torch.tensor([rows[i].tokens], device=self.target.device) for i, _ in members]
            generators = [rows[i].generators[arm] for i, _ in members]
            start = time.perf_counter()
            pending = [self._take_pending(rows[i], arm) for i, _ in members]
            type(generators[0]).observe_many(generators, ids, [outputs for outputs, _ in pending])
            wait_for_device(self.target.device)
            observed = time.perf_counter()
            share = (observed - start) / len(members)
            # A catch-up on states missed while other arms or no drafting ran is paid once, not per round.
            seconds = [share * latest_share for _, latest_share in pending]
            proposals = type(generators[0]).propose_many(generators, ids)  # waits for the device itself
            end = time.perf_counter()
            share = (end - observed) / len(members)
            steady = steady_call_seconds(observed - start, end - observed, [latest for _, latest in pending])
            self.call_seconds[arm] = moving_average(self.call_seconds.get(arm), steady, TIMING_SMOOTHING)
            sizes = self.call_sizes.setdefault(arm, {})
            sizes[len(members)] = moving_average(sizes.get(len(members)), steady, TIMING_SMOOTHING)
            for (i, verified), row_ids, (candidates, logits), caught_up in zip(members, ids, proposals, seconds):
                row, draft = rows[i], candidates[0, row_ids.shape[1]:].tolist()
                if verified:
                    drafts[i] = draft
                    row.draft_logits = logits
                    row.draft_seconds = caught_up + share
                if draft and self._wants_probe(row, arm):
                    self._add_probe(row, arm, draft, self._probe_draft_seconds(arm, batch, caught_up + share))
        return drafts

    def _step(self, rows, cache, valid, queued: bool):
        """One verify forward for every active row: draft, verify, accept, mask the rejected slots;
        ``queued``: whether requests wait for a slot (the batch policy's objective depends on it)."""
        active = [not self._finished(row) for row in rows]
        # Finished rows whose last token's states are still wanted run it through once more.
        flushing = [not a and not self._flushed(row) for row, a in zip(rows, active)]
        policy = self.policy
        batch, context = sum(active), valid.shape[1]
        self._conditions = {"batch": batch, "context": context, "queued": queued}
        if self.route and self._policy_gates_arms:
            for row, is_active in zip(rows, active):
                if is_active:
                    self._leave_closed_drafter(row)
                    self._stop_probing_closed(row)
            self._consolidate(rows)
        # The policy gates each drafter (arm) on its own: rows whose arm it keeps out decode plainly
        # this round, and their drafter catches up on the states it missed when it drafts again.
        arms = {row.arm for row, a in zip(rows, active) if a and (row.generator is not None or self._shadow_arms(row))}
        open_arms = {arm for arm in arms if policy is None or self._policy_drafts(rows, active, arm)}
        closed_arms = arms - open_arms
        drafting_rows = [a and row.arm in open_arms for row, a in zip(rows, active)]
        drafting = any(drafting_rows)
        for row in rows:
            row.draft_seconds, row.draft_logits = 0.0, None
        drafts = self._draft(rows, drafting_rows, batch) if drafting else [[] for _ in rows]
        for row, is_active in zip(rows, active):
            # "No drafter" gains the target's one token a round: a probe of it is any round the
            # policy does not keep the row's arm out of (a closed one would make every arm look like it).
            if is_active and row.arm not in closed_arms and self._wants_probe(row, NO_DRAFTER):
                self._add_probe(row, NO_DRAFTER, [], 0.0)
        width = 1 + max(len(d) for d in drafts)
        if policy is not None and width > 1:
            drafted = [row for row, d, a in zip(rows, drafts, active) if d and a]
            undrafted = [row for row, d, a in zip(rows, drafts, active) if a and not d]
            confidences = [row.generator.last_confidences or [] for row in drafted]
            # Drafting rows first, then the active rows without drafts, as `window` documents.
            remaining = [row.tokens_left for row in drafted + undrafted]
            width = policy.window(confidences, batch, context, queued=queued, remaining=remaining,
                                  arms=[row.arm for row in drafted])
            drafts = [d[: width - 1] for d in drafts]
            for row in rows:
                if row.draft_logits is not None:
                    row.draft_logits = row.draft_logits[:, : width - 1]
        device = self.target.device
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        window_valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        positions = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            window = [row.tokens[-1]] + draft
            ids[i, : len(window)] = torch.tensor(window, device=device)
            window_valid[i, : len(window)] = active[i] or flushing[i]
            positions[i] = _window_positions(row, width, device)
        start = time.perf_counter()
        out = self._forward(ids, valid, window_valid, positions, cache)
        wait_for_device(device)
        forward_seconds = time.perf_counter() - start
        verify_share = forward_seconds / max(sum(active), 1)
        if hasattr(policy, "record_forward"):
            policy.record_forward(forward_seconds, width, context, batch)
        kept = torch.zeros_like(window_valid)
        outcomes, outcome_arms = [], []  # (kept confidences, accepted) of the rows that drafted, and their arms
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            if flushing[i]:
                self._capture(row, out, i, 1)
                row.flushed = True
            if not active[i]:
                continue
            new = self._accept(row, draft, out.logits[i])
            if draft and policy is not None:
                outcomes.append(((row.generator.last_confidences or [])[: len(draft)], len(new) - 1))
                outcome_arms.append(row.arm)
            new = _until_stop(row, new[: row.tokens_left])
            row.tokens += new
            # The pending token and the accepted drafts are now committed; the rest is masked for good.
            kept[i, : len(new)] = True
            self._capture(row, out, i, len(new))
            if row.generators:
                row.accepted.append(len(new) - 1)
                if row.generator is not None:
                    row.generator.update_candidate_strategy(None, None, len(new) - 1)
                self._queue_outputs(row, self._row_outputs(out, i, len(new)))
            if row.probes:
                for probe in row.probes:
                    if probe.verify_seconds is None:
                        probe.verify_seconds = verify_share
                self._score_probes(row, ended=self._finished(row))
        if policy is not None and drafting:
            draft_seconds = {arm: 0.0 for arm in open_arms}
            for row in rows:
                if row.arm in draft_seconds:
                    draft_seconds[row.arm] += row.draft_seconds
            policy.observe(outcomes, batch, width, context, draft_seconds, queued=queued, arms=outcome_arms)
        return cache, torch.cat([valid, kept], dim=1)
