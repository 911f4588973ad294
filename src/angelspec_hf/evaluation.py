"""Measure a drafter through the real ``generate`` path: tau per domain and greedy losslessness."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass
class DomainResult:
    domain: str
    prompts: int = 0
    rounds: int = 0
    new_tokens: int = 0
    identical: int = 0
    seconds_plain: float = 0.0
    seconds_speculative: float = 0.0
    taus: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens per target forward over all prompts (the prefill forward excluded)."""
        return (self.new_tokens - self.prompts) / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau, "lossless": self.identical == self.prompts}


def chat_inputs(tokenizer, prompt: str) -> dict[str, torch.Tensor]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def evaluate_drafter(
    target, tokenizer, drafter, prompts_by_domain: dict[str, list[str]], max_new_tokens: int = 128,
    check_identity: bool = True, first_token_alternatives: int = 0,
) -> dict[str, DomainResult]:
    """Greedy generation with and without ``drafter`` on every prompt; returns per-domain results.

    tau is the drafter's chain alone by default: `generate` also verifies runner-up first tokens
    beside it (``drafter.first_token_alternatives``, docs/dcut.md), which lifts tau without any
    change to the drafter, so training curves and ablations stay comparable with each other and
    with the numbers measured before alternatives existed. Pass ``first_token_alternatives`` to
    measure what `generate` gets with them.
    """
    results = {}
    total = sum(map(len, prompts_by_domain.values()))
    with alternatives_set(drafter, first_token_alternatives), \
            tqdm(total=total, desc="evaluating", unit="prompt") as bar, torch.no_grad():
        for domain, prompts in prompts_by_domain.items():
            result = results[domain] = DomainResult(domain)
            for prompt in prompts:
                inputs = chat_inputs(tokenizer, prompt)
                start = time.perf_counter()
                fast = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
                result.seconds_speculative += time.perf_counter() - start
                stats = drafter.last_speculation_stats
                new = fast.shape[1] - inputs["input_ids"].shape[1]
                result.prompts += 1
                result.rounds += stats.rounds
                result.new_tokens += new
                result.taus.append(stats.tau)
                if check_identity:
                    start = time.perf_counter()
                    plain = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
                    result.seconds_plain += time.perf_counter() - start
                    result.identical += int(torch.equal(plain, fast))
                bar.update(1)
            logger.info("%s: tau %.3f over %d prompts", domain, result.tau, result.prompts)
    return results


@contextmanager
def alternatives_set(drafter, count: int) -> Iterator[None]:
    """``drafter.first_token_alternatives = count`` for the block, restored after it."""
    own = "first_token_alternatives" in vars(drafter)
    previous = getattr(drafter, "first_token_alternatives", 0)
    drafter.first_token_alternatives = count
    try:
        yield
    finally:
        if own:
            drafter.first_token_alternatives = previous
        else:
            del drafter.first_token_alternatives
