"""Batched drafting (`propose_many`): one drafter forward for many rows gives each row what its own
`propose` gives, whatever the rows' context lengths, key padding, budgets and draft policies."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from angelspec_hf.generation.engine import SpeculativeEngine
from conftest import DRAFTER_KINDS, PROMPT_LENGTH

LENGTHS = (PROMPT_LENGTH, PROMPT_LENGTH + 9, PROMPT_LENGTH + 3, PROMPT_LENGTH + 17)


class StopAfter:
    """A draft policy that keeps ``n`` tokens: rows of one batch stop drafting at different steps."""

    def __init__(self, n: int):
        self.n = n

    def should_draft(self) -> bool:
        return self.n > 0

    def keep_drafting(self, confidences, context) -> bool:
        return len(confidences) < self.n

    def choose(self, confidences, context) -> int:
        return min(len(confidences), self.n)

    def observe(self, *args) -> None:
        pass


def ready_generators(target, drafter, sequences, policies, max_lengths):
    """One generator per row, each having ingested its row's context (row 1 left-padded by two)."""
    generators, inputs = [], []
    for row, (length, policy, max_length) in enumerate(zip(LENGTHS, policies, max_lengths)):
        ids = sequences[row : row + 1, :length]
        mask = torch.ones_like(ids)
        if row == 1:
            mask[:, :2] = 0  # the drafter must not attend to a left-padded prompt's padding
        generator = drafter.get_candidate_generator(target=target, generation_config=GenerationConfig(max_length=max_length),
                                                    logits_processor=None)
        generator.policy = policy
        generator.wants_draft_logits = True  # as sampling would: the logits are compared too
        with torch.no_grad():
            out = target(ids[:, :-1], attention_mask=mask[:, :-1], output_hidden_states=True)
        generator.observe_outputs(ids, out, {"attention_mask": mask})
        generators.append(generator)
        inputs.append(ids)
    return generators, inputs


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("with_policy", [False, True])
def test_each_row_of_a_batched_draft_is_its_own_draft(targets, kind, with_policy):
    target, sequences = targets.target("llama"), targets.sequences("llama")
    drafter = targets.fitted("llama", kind)
    policies = [StopAfter(n) for n in (5, 2, 0, 3)] if with_policy else [None] * 4
    # Row 2 has room for one token only (its max length), so the rows' budgets differ too.
    max_lengths = [60, 60, LENGTHS[2] + 2, 60]
    alone, inputs = ready_generators(target, drafter, sequences, policies, max_lengths)
    together, _ = ready_generators(target, drafter, sequences, policies, max_lengths)
    expected = [generator.propose(ids) for generator, ids in zip(alone, inputs)]
    batched = type(together[0]).propose_many(together, inputs)
    drafted = 0
    for (candidates, logits), (want_candidates, want_logits), one, many in zip(batched, expected, alone, together):
        assert torch.equal(candidates, want_candidates)
        if want_logits is None:
            assert logits is None
            continue
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert many.last_draft_length == one.last_draft_length
        if with_policy:
            assert many.last_confidences == pytest.approx(one.last_confidences, rel=1e-4, abs=1e-5)
        drafted += 1
    assert drafted >= 2


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_batched_ingest_keeps_each_rows_own_context(targets, kind):
    target, sequences = targets.target("llama"), targets.sequences("llama")
    drafter = targets.fitted("llama", kind)

    def ingest(generators, extra: int, together: bool):
        ids = [sequences[row : row + 1, : length + extra] for row, length in enumerate(LENGTHS)]
        masks = [torch.ones_like(row_ids) for row_ids in ids]
        masks[1][:, :2] = 0  # row 1 is a left-padded prompt: its padding is among the first new keys
        with torch.no_grad():
            outputs = [target(row_ids, attention_mask=mask, output_hidden_states=True) for row_ids, mask in zip(ids, masks)]
        outputs = [SimpleNamespace(hidden_states=tuple(h[:, generator.committed :] for h in out.hidden_states))
                   for generator, out in zip(generators, outputs)]
        if together:
            type(generators[0]).observe_many(generators, ids, outputs, [{"attention_mask": m} for m in masks])
        else:
            for generator, row_ids, out, mask in zip(generators, ids, outputs, masks):
                generator.observe_outputs(row_ids, out, {"attention_mask": mask})
        return ids

    def fresh():
        generators = [drafter.get_candidate_generator(target=target, generation_config=GenerationConfig(max_length=80),
                                                      logits_processor=None) for _ in LENGTHS]
        for generator in generators:
            generator.wants_draft_logits = True  # as sampling would: the logits are compared too
        return generators

    alone, together = fresh(), fresh()
    # Two rounds, each checked: the prompt, then three more committed positions per row.
    for extra in (0, 3):
        ids = ingest(alone, extra, together=False)
        ingest(together, extra, together=True)
        for one, many, row_ids in zip(alone, together, ids):
            assert many.committed == one.committed == row_ids.shape[1] - 1
            (candidates, logits), (want_candidates, want_logits) = many.propose(row_ids), one.propose(row_ids)
            assert torch.equal(candidates, want_candidates)
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_the_engine_drafts_every_row_in_one_drafter_forward(targets):
    target, sequences = targets.target("llama"), targets.sequences("llama")
    drafter = targets.fitted("llama", "dfly-hybrid-corr")
    prompts = [sequences[i, : PROMPT_LENGTH + i].tolist() for i in range(5)]
    calls = []
    hook = drafter.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    try:
        engine = SpeculativeEngine(target, drafter, max_batch_size=8)
        outputs = engine.generate(prompts, max_new_tokens=12)
    finally:
        hook.remove()
    for prompt, output in zip(prompts, outputs):
        assert output == target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                         eos_token_id=None)[0].tolist()
    assert calls[0] == len(prompts), "the first drafting round must be one forward over every row"
    rounds = max(entry["rounds"] for entry in engine.stats)
    assert len(calls) <= rounds, "one drafter forward per engine step, not one per row"


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("settings, keeps_logits", [
    ({}, False),
    ({"do_sample": True}, True),
    ({"assistant_ensemble_weight": 0.5}, True),
])
def test_draft_logits_are_kept_only_where_verification_reads_them(targets, kind, settings, keeps_logits):
    target, sequences = targets.target("llama"), targets.sequences("llama")
    drafter = targets.fitted("llama", kind)
    ids = sequences[:1, : LENGTHS[0]]
    generator = drafter.get_candidate_generator(
        target=target, generation_config=GenerationConfig(max_length=60, **settings), logits_processor=None)
    with torch.no_grad():
        generator.observe_outputs(ids, target(ids[:, :-1], output_hidden_states=True))
    candidates, logits = generator.propose(ids)
    drafted = candidates.shape[1] - ids.shape[1]
    assert drafted >= 1
    if keeps_logits:
        assert logits.shape == (1, drafted, target.config.vocab_size)
    else:
        assert logits is None
