"""Measure a drafter through the real ``generate`` path: tau per domain and greedy losslessness."""

from __future__ import annotations

import logging
import time
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
    check_identity: bool = True,
) -> dict[str, DomainResult]:
    """Greedy generation with and without ``drafter`` on every prompt; returns per-domain results."""
    results = {}
    total = sum(map(len, prompts_by_domain.values()))
    with tqdm(total=total, desc="evaluating", unit="prompt") as bar, torch.no_grad():
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
