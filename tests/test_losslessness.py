"""Greedy speculative output must be token-identical to plain ``target.generate``."""

import copy

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from conftest import DRAFTER_KINDS, FAMILIES, PROMPT_LENGTH, build_drafter


def plain_and_speculative(target, drafter, prompt, **kwargs):
    kwargs.setdefault("do_sample", False)
    plain = target.generate(prompt, **kwargs)
    speculative = target.generate(prompt, assistant_model=drafter, **kwargs)
    return plain, speculative


def evaluation_prompts(targets, family):
    """Prompts the drafter was fitted on (high acceptance) and unseen random ones (rejections)."""
    seen = targets.sequences(family)[:4, :PROMPT_LENGTH]
    generator = torch.Generator().manual_seed(7)
    unseen = torch.randint(3, targets.target(family).config.vocab_size, (2, 9), generator=generator)
    return [row[None] for row in seen] + [row[None] for row in unseen]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_greedy_identical_with_accepting_drafter(targets, family, kind):
    target, drafter = targets.target(family), targets.fitted(family, kind)
    drafted, accepted = [], []
    for prompt in evaluation_prompts(targets, family):
        for max_new_tokens in (1, 5, 33):
            plain, speculative = plain_and_speculative(target, drafter, prompt, max_new_tokens=max_new_tokens, eos_token_id=None)
            assert torch.equal(plain, speculative), (kind, prompt.tolist(), max_new_tokens)
            stats = drafter.last_speculation_stats
            # Every token comes from the prefill, an accepted draft or a verify forward's own token.
            assert speculative.shape[1] - prompt.shape[1] == 1 + sum(stats.accepted) + stats.rounds
            drafted += stats.drafted
            accepted += stats.accepted
    full = sum(a == d > 0 for a, d in zip(accepted, drafted))
    partial = sum(0 < a < d for a, d in zip(accepted, drafted))
    rejected = sum(a == 0 < d for a, d in zip(accepted, drafted))
    # The fitted drafter must really be accepted, so rollback and the bonus token are exercised.
    assert full > 0 and rejected > 0, (kind, full, partial, rejected)
    assert partial + full >= 3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_greedy_identical_with_random_drafter(targets, family, kind):
    target = targets.target(family)
    torch.manual_seed(3)
    drafter = build_drafter(kind, target).eval()
    for prompt in evaluation_prompts(targets, family)[3:]:
        plain, speculative = plain_and_speculative(target, drafter, prompt, max_new_tokens=17, eos_token_id=None)
        assert torch.equal(plain, speculative)


@pytest.mark.parametrize("kind", ["mtp", "dfly-hybrid-corr"])
def test_eos_stops_like_plain_generate(targets, kind):
    target, drafter = targets.target("llama"), targets.fitted("llama", kind)
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    free = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None)
    eos = int(free[0, PROMPT_LENGTH + 12])
    plain, speculative = plain_and_speculative(target, drafter, prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(plain, speculative)
    assert int(speculative[0, -1]) == eos and speculative.shape[1] < free.shape[1]


@pytest.mark.parametrize("kind", ["mtp-reduced", "dfly-global-nocorr", "dfly-hybrid-corr-reduced"])
def test_logits_processors_greedy(targets, kind):
    target, drafter = targets.target("qwen3"), targets.fitted("qwen3", kind)
    for prompt in evaluation_prompts(targets, "qwen3")[:3]:
        plain, speculative = plain_and_speculative(
            target, drafter, prompt, max_new_tokens=25, eos_token_id=None, repetition_penalty=1.3, no_repeat_ngram_size=3
        )
        assert torch.equal(plain, speculative)


def test_bfloat16_drafter_scores_its_draft_vocabulary_in_bfloat16(targets):
    """A bfloat16 drafter on a float32 target drafts with a bfloat16 copy of its vocabulary's rows of
    the target head (half the bytes each draft step reads); the output is still the target's own."""
    target = targets.target("llama")
    drafter = copy.deepcopy(targets.fitted("llama", "dfly-hybrid-corr-reduced")).to(torch.bfloat16)
    generator = drafter.get_candidate_generator(target=target, generation_config=GenerationConfig(max_length=60),
                                                logits_processor=None)
    assert generator.draft_lm_head.weight.dtype == torch.bfloat16
    assert target.lm_head.weight.dtype == torch.float32
    accepted = 0
    for prompt in evaluation_prompts(targets, "llama"):
        plain, speculative = plain_and_speculative(target, drafter, prompt, max_new_tokens=20, eos_token_id=None)
        assert torch.equal(plain, speculative)
        accepted += sum(drafter.last_speculation_stats.accepted)
    assert accepted > 0


def test_return_dict_scores_and_hidden_states(targets):
    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-hybrid-corr")
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    kwargs = dict(max_new_tokens=20, eos_token_id=None, return_dict_in_generate=True, output_scores=True, output_hidden_states=True)
    plain, speculative = plain_and_speculative(target, drafter, prompt, **kwargs)
    assert torch.equal(plain.sequences, speculative.sequences)
    assert len(plain.scores) == len(speculative.scores) == 20
    for a, b in zip(plain.scores, speculative.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(speculative.hidden_states) == len(plain.hidden_states)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_sees_the_same_tokens(targets):
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp")
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    plain_stream, speculative_stream = Collect(), Collect()
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, streamer=plain_stream)
    speculative = target.generate(
        prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None, streamer=speculative_stream
    )
    flatten = lambda chunks: [token for chunk in chunks[:-1] for token in chunk]  # noqa: E731
    assert flatten(speculative_stream.chunks) == flatten(plain_stream.chunks) == plain[0].tolist()
    assert speculative_stream.chunks[-1] == "end"
    assert torch.equal(plain, speculative)
    # Accepted drafts arrive several tokens per chunk.
    assert max(len(chunk) for chunk in speculative_stream.chunks[1:-1]) > 1


@pytest.mark.parametrize("kind", ["mtp", "dfly-layerwise-corr"])
def test_left_padded_prompt(targets, kind):
    target, drafter = targets.target("llama"), targets.fitted("llama", kind)
    prompt = torch.cat([torch.zeros(1, 3, dtype=torch.long), targets.sequences("llama")[:1, :PROMPT_LENGTH]], dim=1)
    mask = torch.ones_like(prompt)
    mask[:, :3] = 0
    plain, speculative = plain_and_speculative(target, drafter, prompt, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(plain, speculative)


def test_bf16_drafter_on_fp32_target(targets):
    target = targets.target("llama")
    drafter = build_drafter("dfly-hybrid-corr", target).to(torch.bfloat16).eval()
    prompt = evaluation_prompts(targets, "llama")[0]
    plain, speculative = plain_and_speculative(target, drafter, prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(plain, speculative)
