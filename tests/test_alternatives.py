"""First-token alternatives: runner-up draft tokens verified beside the chain in one forward
(`AlternativesVerification`). Greedy output must stay token-identical to plain ``generate``."""

import pytest
import torch

from angelspec_hf.modeling_angelspec_common import (
    AngelSpecCandidateGenerator,
    AngelSpecPreTrainedModel,
    target_applies_tree_masks,
    tree_attention_mask,
)
from angelspec_hf.reference import tiny_target

from conftest import FAMILIES, PROMPT_LENGTH

KINDS = ("mtp", "dfly-hybrid-corr")


def oracle_rounds(monkeypatch, reference: torch.Tensor, vocab_size: int, chain_right: bool = False) -> None:
    """Make every round's first drafted token wrong and put the target's own next token (read from
    ``reference``, the plain greedy output) second among two alternatives, so that each round can
    only gain through an alternative; with ``chain_right`` the chain's first token is right instead."""
    finish = AngelSpecCandidateGenerator._finish_round
    # Room for both alternatives beside any of these drafts (the default width suits a CPU).
    monkeypatch.setattr(AngelSpecPreTrainedModel, "alternatives_verify_width", 64)

    def rigged(self, input_ids, tokens, logits, seconds):
        position = input_ids.shape[1]
        if self.alternatives and position < reference.shape[1]:
            truth = int(reference[0, position])
            tokens = tokens.clone()
            tokens[0, 0] = truth if chain_right else (truth + 1) % vocab_size
            self.drafted_alternatives = torch.tensor([(truth + 2) % vocab_size, truth])
        return finish(self, input_ids, tokens, logits, seconds)

    monkeypatch.setattr(AngelSpecCandidateGenerator, "_finish_round", rigged)


def sharp_target(family: str, seed: int = 3, **overrides):
    """A tiny random target whose attention is far from uniform (queries and keys scaled up), so
    that a wrong key in the cache changes its output; at initialisation scale every key looks alike."""
    target = tiny_target(family, seed=seed, **overrides)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    target.requires_grad_(False)
    return target


def untrained_drafter(kind: str, target):
    from angelspec_hf import DFlyDrafter, MTPDrafter

    torch.manual_seed(0)
    if kind == "mtp":
        return MTPDrafter.from_target(target, num_draft_tokens=4)
    return DFlyDrafter.from_target(target, block_size=6, conditioning="hybrid", hidden_correction=True)


def assert_identical_through_alternatives(targets, monkeypatch, target, drafter, max_new_tokens: int = 24) -> None:
    """Greedy output equals plain decoding's when every round can only gain through an alternative."""
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size)
    speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None)
    assert torch.equal(plain, speculative)
    assert drafter.last_speculation_stats.alternative_hits >= 3


def test_tree_mask_rows():
    # Past keys 0-2 (key 0 is padding), the committed token at 3, drafts at 4-5, alternatives at 6-7.
    mask = tree_attention_mask(torch.tensor([[0, 1, 1, 1, 1, 1]]), past=3, width=3, alternatives=2, additive_dtype=None)
    expected = torch.tensor([
        [0, 1, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0, 0, 1, 0],
        [0, 1, 1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)
    additive = tree_attention_mask(None, past=1, width=2, alternatives=1, additive_dtype=torch.float32)
    assert additive[0, 0, 2, 2].item() == torch.finfo(torch.float32).min and additive[0, 0, 2, 3].item() == 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_accepted_alternatives_keep_output_identical(targets, monkeypatch, family, kind):
    target = sharp_target(family)
    drafter = untrained_drafter(kind, target)
    prompt = targets.sequences(family)[5:6, :PROMPT_LENGTH]
    for max_new_tokens in (1, 2, 3, 8, 30):
        plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
        with monkeypatch.context() as patch:
            oracle_rounds(patch, plain, target.config.vocab_size)
            speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens,
                                          do_sample=False, eos_token_id=None)
        assert torch.equal(plain, speculative), (kind, max_new_tokens)
        stats = drafter.last_speculation_stats
        assert stats.alternative_hits == sum(drafted > 0 for drafted in stats.drafted)
        # Each round kept the alternative and the target's token after it (the last may be cut by length).
        assert speculative.shape[1] - prompt.shape[1] == 1 + sum(stats.accepted) + stats.rounds
        if max_new_tokens == 30:
            assert stats.rounds <= 15


@pytest.mark.parametrize("kind", KINDS)
def test_chain_right_beside_alternatives(targets, monkeypatch, kind):
    target, drafter = targets.target("llama"), targets.fitted("llama", kind)
    prompt = targets.sequences("llama")[6:7, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size, chain_right=True)
    speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(plain, speculative)
    stats = drafter.last_speculation_stats
    assert stats.alternative_hits == 0
    assert all(accepted >= 1 for accepted, drafted in zip(stats.accepted, stats.drafted) if drafted)


def test_alternative_that_is_eos_stops_generation(targets, monkeypatch):
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp")
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    reference = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(reference[0, PROMPT_LENGTH + 5])  # a token the target emits: generation must stop there
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert plain.shape[1] < reference.shape[1]
    oracle_rounds(monkeypatch, reference, target.config.vocab_size)
    speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert torch.equal(plain, speculative)
    assert drafter.last_speculation_stats.alternative_hits >= 1


def test_left_padded_prompt_with_alternatives(targets, monkeypatch):
    target, drafter = targets.target("qwen3"), targets.fitted("qwen3", "dfly-hybrid-corr")
    prompt = torch.cat([torch.zeros(1, 3, dtype=torch.long), targets.sequences("qwen3")[5:6, :PROMPT_LENGTH]], dim=-1)
    mask = (prompt != 0).long()
    plain = target.generate(prompt, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size)
    speculative = target.generate(prompt, attention_mask=mask, assistant_model=drafter, max_new_tokens=16,
                                  do_sample=False, eos_token_id=None)
    assert torch.equal(plain, speculative)
    assert drafter.last_speculation_stats.alternative_hits >= 1


def test_eager_attention_target(targets, monkeypatch):
    target = sharp_target("llama")
    target.set_attn_implementation("eager")
    assert_identical_through_alternatives(targets, monkeypatch, target, untrained_drafter("mtp", target))


def generate_recording_widths(target, drafter, prompt, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy speculative output, and the number of new tokens each target forward was called with
    (before our hook widens it)."""
    widths: list[int] = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]) if "input_ids" in kwargs else None,
        with_kwargs=True)
    try:
        output = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None)
    finally:
        handle.remove()
    return output, widths


def test_off_where_the_call_or_target_does_not_allow_them(targets, monkeypatch):
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp")
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size)
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    for kwargs in (
        {"do_sample": True, "top_k": 4},
        {"logits_processor": LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])},
        {"return_dict_in_generate": True, "output_hidden_states": True},
    ):
        kwargs.setdefault("do_sample", False)
        target.generate(prompt, assistant_model=drafter, max_new_tokens=12, eos_token_id=None, **kwargs)
        assert drafter.last_speculation_stats.alternative_hits == 0, kwargs
    from angelspec_hf.evaluation import alternatives_set

    with alternatives_set(drafter, 0):
        speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(plain, speculative) and drafter.last_speculation_stats.alternative_hits == 0
    # No forward hook outlives a call.
    assert not target._forward_hooks and not target._forward_pre_hooks


def test_sliding_window_cache_verifies_the_chain_only(targets, monkeypatch):
    target = tiny_target("mistral", seed=2, sliding_window=8)
    from angelspec_hf import MTPDrafter

    drafter = MTPDrafter.from_target(target, num_draft_tokens=3)
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size)
    speculative, widths = generate_recording_widths(target, drafter, prompt, 16)
    assert torch.equal(plain, speculative)
    stats = drafter.last_speculation_stats
    assert stats.alternative_hits == 0 and widths[1:] == [drafted + 1 for drafted in stats.drafted]


def test_target_that_ignores_tree_masks_is_detected(targets, monkeypatch):
    target = tiny_target("llama", seed=4)
    assert target_applies_tree_masks(target)

    def drop_mask_and_positions(module, args, kwargs):
        kwargs.pop("attention_mask", None)
        kwargs.pop("position_ids", None)
        return args, kwargs

    handle = target.register_forward_pre_hook(drop_mask_and_positions, with_kwargs=True, prepend=True)
    try:
        del target._angelspec_tree_mask_check
        assert not target_applies_tree_masks(target)
    finally:
        handle.remove()


def generate_with_policy(target, drafter, prompt, policy, max_new_tokens: int = 12) -> torch.Tensor:
    """Greedy speculative output with ``policy`` as the drafter's draft policy for the call."""
    drafter.draft_policy = policy
    try:
        return target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None)
    finally:
        del drafter.draft_policy


def test_draft_policy_sees_the_chain_rejected(targets, monkeypatch):
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp")
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size)

    class Recording:
        def __init__(self):
            self.observed, self.widths = [], []

        def should_draft(self):
            return True

        def keep_drafting(self, confidences, context):
            return True

        def choose(self, confidences, context):
            return len(confidences)

        def record_forward(self, seconds, width, context):
            self.widths.append(width)

        def observe(self, confidences, matches, seconds, context):
            self.observed.append(matches)

    policy = Recording()
    assert torch.equal(plain, generate_with_policy(target, drafter, prompt, policy))
    stats = drafter.last_speculation_stats
    drafting_rounds = sum(drafted > 0 for drafted in stats.drafted)
    assert drafting_rounds >= 3 and stats.alternative_hits == drafting_rounds
    assert policy.observed == [0] * drafting_rounds
    assert policy.widths == [drafted + 1 + (2 if drafted else 0) for drafted in stats.drafted]


def test_a_policy_that_weighs_alternatives_is_told_them(targets, monkeypatch):
    """A policy declaring ``weighs_alternatives`` gets the alternatives' draft probabilities and the
    forward's width limit with each decision, and after the forward the ones verified and which one
    the target took (here always the second, `oracle_rounds`)."""
    target, drafter = targets.target("llama"), targets.fitted("llama", "mtp")
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    oracle_rounds(monkeypatch, plain, target.config.vocab_size)

    class Weighing:
        weighs_alternatives = True

        def __init__(self):
            self.asked, self.observed = [], []

        def should_draft(self):
            return True

        def keep_drafting(self, confidences, context, **alternatives):
            self.asked.append(("keep", alternatives))
            return True

        def choose(self, confidences, context, **alternatives):
            self.asked.append(("choose", alternatives))
            return len(confidences)

        def observe(self, confidences, matches, seconds, context, **alternatives):
            self.observed.append((matches, alternatives))

    policy = Weighing()
    assert torch.equal(plain, generate_with_policy(target, drafter, prompt, policy))
    assert policy.asked and all(set(kw) == {"alternatives", "alternatives_width"} for _, kw in policy.asked)
    assert all(len(kw["alternatives"]) == 2 and kw["alternatives_width"] == 64 and 0 <= min(kw["alternatives"])
               and sum(kw["alternatives"]) <= 1 for _, kw in policy.asked)
    drafting_rounds = sum(drafted > 0 for drafted in drafter.last_speculation_stats.drafted)
    assert len(policy.observed) == drafting_rounds >= 3
    assert all(matches == 0 and len(kw["alternatives"]) == 2 and kw["alternative_hit"] == 1
               for matches, kw in policy.observed)


@pytest.mark.parametrize("kind", KINDS)
def test_alternatives_stay_within_the_verify_width(targets, kind):
    target = sharp_target("llama")
    drafter = untrained_drafter(kind, target)  # MTP drafts 4 (a forward of 5), DFly 5 (a forward of 6)
    prompt = targets.sequences("llama")[5:6, :PROMPT_LENGTH]
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    speculative, widths = generate_recording_widths(target, drafter, prompt, 24)
    assert torch.equal(plain, speculative)
    stats = drafter.last_speculation_stats
    # Our hook runs after the recording one, so each recorded width is the chain's; the forward
    # itself grew to at most 6 tokens: one alternative beside MTP's 5, none beside DFly's 6.
    assert widths[1:] == [drafted + 1 for drafted in stats.drafted]
    room = {"mtp": 1, "dfly-hybrid-corr": 0}[kind]
    grown: list[int] = []
    handle = target.register_forward_hook(
        lambda module, args, kwargs, output: grown.append(output.logits.shape[1]), with_kwargs=True, prepend=True)
    try:
        target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None)
    finally:
        handle.remove()
    full_rounds = [i for i, drafted in enumerate(stats.drafted) if drafted == max(stats.drafted)]
    assert all(grown[1 + i] == stats.drafted[i] + 1 + room for i in full_rounds)


def test_exact_bfloat16_verification_with_alternatives(targets, monkeypatch):
    """Alternatives under the row-stable bfloat16 kernels: bit-identical greedy output."""
    from angelspec_hf.generation import make_verification_exact

    target = sharp_target("llama").to(torch.bfloat16)
    make_verification_exact(target, max_rows=10)
    drafter = untrained_drafter("mtp", target).to(torch.bfloat16)
    assert_identical_through_alternatives(targets, monkeypatch, target, drafter)


def test_evaluation_measures_the_chain_and_restores_the_setting(targets):
    from angelspec_hf.evaluation import alternatives_set

    drafter = targets.fitted("llama", "mtp")
    with alternatives_set(drafter, 0):
        assert drafter.first_token_alternatives == 0
    assert "first_token_alternatives" not in vars(drafter) and drafter.first_token_alternatives == 2
    drafter.first_token_alternatives = 1
    try:
        with pytest.raises(RuntimeError), alternatives_set(drafter, 0):
            raise RuntimeError("interrupted")
        assert drafter.first_token_alternatives == 1
    finally:
        del drafter.first_token_alternatives


def test_generate_on_two_threads_keeps_each_calls_alternatives_apart(targets, monkeypatch):
    import threading

    target = sharp_target("llama")
    prompts = [targets.sequences("llama")[row:row + 1, :PROMPT_LENGTH] for row in (5, 6)]
    plains = [target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None) for prompt in prompts]
    drafters = [untrained_drafter("mtp", target) for _ in prompts]
    monkeypatch.setattr(AngelSpecPreTrainedModel, "alternatives_verify_width", 64)
    finish = AngelSpecCandidateGenerator._finish_round

    def rigged(self, input_ids, tokens, logits, seconds):
        reference = plains[drafters.index(self.drafter)]
        if self.alternatives and input_ids.shape[1] < reference.shape[1]:
            truth = int(reference[0, input_ids.shape[1]])
            tokens = tokens.clone()
            tokens[0, 0] = (truth + 1) % target.config.vocab_size
            self.drafted_alternatives = torch.tensor([truth])
        return finish(self, input_ids, tokens, logits, seconds)

    monkeypatch.setattr(AngelSpecCandidateGenerator, "_finish_round", rigged)
    outputs: dict[int, list] = {0: [], 1: []}

    def work(index: int) -> None:
        for _ in range(3):
            outputs[index].append(target.generate(prompts[index], assistant_model=drafters[index], max_new_tokens=20,
                                                  do_sample=False, eos_token_id=None))

    threads = [threading.Thread(target=work, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in (0, 1):
        assert len(outputs[index]) == 3 and all(torch.equal(out, plains[index]) for out in outputs[index])
        assert drafters[index].last_speculation_stats.alternative_hits >= 3
    assert not target._forward_hooks and not target._forward_pre_hooks


@pytest.mark.parametrize("reduced", [False, True])
def test_alternatives_are_the_first_positions_runners_up(reduced):
    from types import SimpleNamespace

    from angelspec_hf.modeling_angelspec_common import BatchedDraft

    def generator(alternatives: int, weighs: bool = False):
        return SimpleNamespace(drafter=SimpleNamespace(config=SimpleNamespace(vocab_size=50)), logits_processor=None,
                               wants_draft_logits=False, policy=None, do_sample=False, alternatives=alternatives,
                               drafted_alternatives=None, keep_drafting=lambda context: True,
                               policy_weighs_alternatives=weighs, alternative_confidences=[])

    rows = [generator(2), generator(0), generator(2, weighs=True)]
    token_ids = torch.arange(10, 20) if reduced else None
    columns = 10 if reduced else 50
    logits = torch.full((3, columns), -5.0)
    logits[:, 3], logits[:, 7], logits[:, 1], logits[:, 4] = 4.0, 3.0, 2.0, 1.0
    draft = BatchedDraft(rows, [torch.zeros(1, 4, dtype=torch.long)] * 3, [3, 3, 3], token_ids)
    chosen = draft.choose(logits, 0)
    offset = 10 if reduced else 0
    assert chosen[:, 0].tolist() == [3 + offset] * 3
    assert rows[0].drafted_alternatives.tolist() == [7 + offset, 1 + offset] and rows[1].drafted_alternatives is None
    # Their draft probabilities only for a generator whose policy weighs them.
    assert rows[0].alternative_confidences == [] and rows[1].alternative_confidences == []
    assert rows[2].alternative_confidences == pytest.approx(logits[2].softmax(-1)[[7, 1]].tolist())
    rows[0].drafted_alternatives = None
    draft.choose(logits, 1)  # later positions draft no alternatives
    assert rows[0].drafted_alternatives is None


def test_scores_of_tokens_won_by_alternatives(targets, monkeypatch):
    target = sharp_target("qwen3")
    drafter = untrained_drafter("mtp", target)
    prompt = targets.sequences("qwen3")[5:6, :PROMPT_LENGTH]
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    plain = target.generate(prompt, **kwargs)
    oracle_rounds(monkeypatch, plain.sequences, target.config.vocab_size)
    speculative = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(plain.sequences, speculative.sequences)
    assert drafter.last_speculation_stats.alternative_hits >= 3
    assert len(speculative.scores) == len(plain.scores) == 16
    for ours, theirs in zip(speculative.logits, plain.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_negative_number_of_alternatives_is_refused_by_name(targets):
    from angelspec_hf.errors import DrafterConfigError

    target = sharp_target("llama")
    drafter = untrained_drafter("mtp", target)
    drafter.first_token_alternatives = -1
    with pytest.raises(DrafterConfigError, match="first_token_alternatives"):
        target.generate(targets.sequences("llama")[5:6, :PROMPT_LENGTH], assistant_model=drafter, max_new_tokens=4,
                        do_sample=False)
    assert not target._forward_hooks and not target._forward_pre_hooks
