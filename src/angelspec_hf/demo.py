"""What the Gradio Space shows, without Gradio: generation streamed round by round, with each
round's accepted draft tokens marked, plus the comparison of plain and speculative decoding.

``target.generate`` hands its streamer the prompt first and then, for every verify round, the
tokens that round committed: the accepted drafts followed by the target's own token. So each
chunk after the prompt is one round, and all but its last token were drafted and accepted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from .evaluation import chat_inputs


class RoundStreamer(BaseStreamer):
    """Receives generate's chunks on the generating thread and queues one list of ids per round."""

    def __init__(self):
        self.rounds: queue.Queue = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.rounds.put(value.flatten().tolist())

    def end(self) -> None:
        self.rounds.put(None)


def stream_rounds(target, inputs: dict, max_new_tokens: int, **generate_kwargs) -> Iterator[list[int]]:
    """Run ``target.generate`` on a worker thread and yield the ids each round commits.

    An exception in ``generate`` is raised here, after the rounds that came before it.
    """
    streamer = RoundStreamer()
    failure: list[BaseException] = []

    def work():
        try:
            with torch.no_grad():
                target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                                **generate_kwargs)
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)
            streamer.rounds.put(None)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    while (chunk := streamer.rounds.get()) is not None:
        yield chunk
    worker.join()
    if failure:
        raise failure[0]


@dataclass
class RunView:
    """One generation as the Space draws it: tokens, which were accepted drafts, timing."""

    token_ids: list[int] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)  # per token: an accepted draft (else the target's own)
    accepted_per_round: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add_round(self, ids: list[int], speculative: bool) -> None:
        accepted = len(ids) - 1 if speculative else 0
        self.token_ids += ids
        self.drafted += [True] * accepted + [False]
        if speculative:
            self.accepted_per_round.append(accepted)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        """Tokens per verify round, the prefill round (which drafts nothing) left out."""
        rounds = self.accepted_per_round[1:]
        return (sum(rounds) + len(rounds)) / len(rounds) if rounds else None


def generate_view(target, inputs: dict, max_new_tokens: int, drafter=None, policy=None) -> Iterator[RunView]:
    """Yield the growing `RunView` after every round (plain decoding when ``drafter`` is None)."""
    view = RunView()
    kwargs = {} if drafter is None else {"assistant_model": drafter}
    if policy is not None:
        drafter.draft_policy = policy
    start = time.perf_counter()
    try:
        for ids in stream_rounds(target, inputs, max_new_tokens, **kwargs):
            view.add_round(ids, speculative=drafter is not None)
            view.seconds = time.perf_counter() - start
            yield view
    finally:
        if policy is not None:
            del drafter.draft_policy
    view.seconds = time.perf_counter() - start
    yield view


def segments(tokenizer, view: RunView) -> list[tuple[str, str | None]]:
    """(text, label) pieces for highlighting: runs of tokens of one kind.

    Each piece is the growth of the decoded prefix, so spacing comes out exactly as decoding the
    whole output does (decoding pieces alone would drop the spaces some tokenizers insert).
    """
    pieces: list[tuple[str, str | None]] = []
    start, decoded = 0, ""
    for i in range(1, len(view.token_ids) + 1):
        if i == len(view.token_ids) or view.drafted[i] != view.drafted[start]:
            text = tokenizer.decode(view.token_ids[:i], skip_special_tokens=True)
            pieces.append((text[len(decoded):], "accepted draft" if view.drafted[start] else None))
            start, decoded = i, text
    return pieces


@dataclass
class Comparison:
    plain_text: str
    speculative_text: str
    identical: bool
    tau: float | None
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    speedup: float
    accepted_per_round: list[int]

    def as_dict(self) -> dict:
        return asdict(self)


def compare(target, tokenizer, prompt: str, drafter, max_new_tokens: int = 64, policy=None) -> Comparison:
    """Plain then speculative greedy generation of one chat prompt, with what the Space reports."""
    inputs = chat_inputs(tokenizer, prompt)
    views = []
    for model, cut in ((None, None), (drafter, policy)):
        view = RunView()
        for view in generate_view(target, inputs, max_new_tokens, model, cut):
            pass
        views.append(view)
    plain, speculative = views
    return Comparison(
        plain_text=tokenizer.decode(plain.token_ids, skip_special_tokens=True),
        speculative_text=tokenizer.decode(speculative.token_ids, skip_special_tokens=True),
        identical=plain.token_ids == speculative.token_ids,
        tau=speculative.tau,
        plain_tokens_per_s=plain.tokens_per_s,
        speculative_tokens_per_s=speculative.tokens_per_s,
        speedup=speculative.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        accepted_per_round=speculative.accepted_per_round,
    )


def engine_view(target, inputs: dict, max_new_tokens: int, drafters: dict, eos_token_id=None) -> Iterator[RunView]:
    """Yield the growing `RunView` of one request through `SpeculativeEngine` with online routing
    over ``drafters``, after every engine step (each step is one verify round of the request)."""
    from .generation import SpeculativeEngine

    prompt = inputs["input_ids"][0].tolist()
    engine = SpeculativeEngine(target, drafters, max_batch_size=1)
    view = RunView()
    start = time.perf_counter()
    with torch.no_grad():
        for event in engine.stream([prompt], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id):
            if event.error is not None:
                raise event.error
            tokens = event.tokens
            if not view.token_ids and tokens:
                view.add_round(tokens[:1], speculative=True)  # the prefill's token, its own round
                tokens = tokens[1:]
            if tokens:
                view.add_round(tokens, speculative=True)
            view.seconds = time.perf_counter() - start
            yield view
