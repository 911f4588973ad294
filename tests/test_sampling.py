"""Speculative sampling must preserve the target's distribution.

On a 10-token vocabulary we draw many continuations with and without a drafter and compare the
empirical distributions with a chi-square test of homogeneity. Seeds are fixed, so the outcome is
deterministic; the tolerance is a p-value of 1e-3 per compared marginal. A control shows that
the same test, with the same sample size, does detect a small change of the distribution.
"""

import pytest
import torch
from scipy.stats import chi2_contingency

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.generation import CostModel, DCutPolicy
from angelspec_hf.reference import tiny_target

VOCAB = 10
NEW_TOKENS = 4
SAMPLES = 1000
MIN_P_VALUE = 1e-3


@pytest.fixture(scope="module")
def small_target():
    model = tiny_target("llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, seed=11)
    # Sharpen the random model a little so that drafts are accepted a fair share of the time.
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


PROMPT = torch.tensor([[3, 7, 5, 4]])


@pytest.fixture(autouse=True)
def one_row_kernel(monkeypatch):
    """Every one-row draft product through ``F.linear``: the kernel is otherwise picked by timing,
    and another kernel's rounding moves the draws, so each test's fixed seeds would meet other
    samples from run to run."""
    from angelspec_hf import modeling_angelspec_common as common

    monkeypatch.setattr(common, "fastest_row_kernel", lambda weight: "linear")


def plain_samples(target, seed, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    prompts = PROMPT.repeat(SAMPLES, 1)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[:, PROMPT.shape[1]:]


def speculative_samples(target, drafter, seed, **kwargs) -> tuple[torch.Tensor, int]:
    torch.manual_seed(seed)
    rows, accepted = [], 0
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, assistant_model=drafter, do_sample=True, max_new_tokens=NEW_TOKENS,
                              eos_token_id=None, **kwargs)
        rows.append(out[0, PROMPT.shape[1]:])
        accepted += sum(drafter.last_speculation_stats.accepted)
    return torch.stack(rows), accepted


def min_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Smallest chi-square p-value over the per-position marginals and the (second, third) pair."""
    p_values = []
    columns = [(a[:, i], b[:, i]) for i in range(NEW_TOKENS)]
    columns.append((a[:, 1] * VOCAB + a[:, 2], b[:, 1] * VOCAB + b[:, 2]))
    for left, right in columns:
        categories = torch.unique(torch.cat([left, right]))
        table = torch.stack([(left[:, None] == categories).sum(0), (right[:, None] == categories).sum(0)])
        table = table[:, table.sum(0) >= 5]  # chi-square needs populated cells
        if table.shape[1] > 1:
            p_values.append(chi2_contingency(table.numpy()).pvalue)
    return min(p_values)


def drafters(target):
    torch.manual_seed(5)
    cut = DFlyDrafter.from_target(target, block_size=4).eval()
    # A verification cost curve under which D-cut really cuts: the draft length then depends on
    # the draft's own confidences, which must not bias the output distribution.
    cut.draft_policy = DCutPolicy(CostModel(target="t", hardware="t", tokens=[1, 4], contexts=[0, 100],
                                            seconds=[[1.0, 1.0], [1.6, 1.6]]), explore_every=5, max_backoff=1,
                                  track_pace=False)
    # Measured drafting time would enter the cut (milliseconds against the curve's seconds, enough to
    # flip a near tie now and then) and make the draws differ from run to run: count it as free.
    cut.draft_policy.in_profile_time = lambda seconds: 0.0
    return {
        "mtp": MTPDrafter.from_target(target, num_draft_tokens=3).eval(),
        "dfly": DFlyDrafter.from_target(target, block_size=4).eval(),
        "dfly+dcut": cut,
        # Tokens outside the draft vocabulary can only come from the residual distribution.
        "dfly-reduced": DFlyDrafter.from_target(target, block_size=4, draft_token_ids=[1, 3, 4, 6, 8]).eval(),
    }


@pytest.mark.parametrize("name", ["mtp", "dfly", "dfly+dcut", "dfly-reduced"])
@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_k": 6}], ids=["t1", "t0.7-top6"])
def test_speculative_sampling_matches_plain_sampling(small_target, name, settings):
    drafter = drafters(small_target)[name]
    plain = plain_samples(small_target, seed=1, **settings)
    speculative, accepted = speculative_samples(small_target, drafter, seed=2, **settings)
    assert accepted > SAMPLES // 4, "drafts must be accepted often enough for the test to mean something"
    assert min_p_value(plain, speculative) > MIN_P_VALUE


def test_control_detects_a_slightly_warmer_target(small_target):
    plain = plain_samples(small_target, seed=1)
    warmer = plain_samples(small_target, seed=2, temperature=1.5)
    assert min_p_value(plain, warmer) < MIN_P_VALUE


def test_control_detects_verification_that_accepts_every_draft(small_target, monkeypatch):
    """Had the verification step been skipped (every draft accepted), this test would see it."""
    import transformers.generation.utils as generation_utils

    def accept_everything(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        bonus = torch.multinomial(new_logits[0, -1].softmax(dim=-1), 1)[None]
        return torch.cat([candidate_input_ids[:, -candidate_length:], bonus], dim=-1), torch.tensor(candidate_length)

    monkeypatch.setattr(generation_utils, "_speculative_sampling", accept_everything)
    plain = plain_samples(small_target, seed=1)
    biased, _ = speculative_samples(small_target, drafters(small_target)["dfly"], seed=2)
    assert min_p_value(plain, biased) < MIN_P_VALUE


def test_sampling_without_warpers_over_draft_vocabulary_columns(small_target, monkeypatch):
    """With no logits processor at all (temperature 1, no top-k/top-p), a reduced drafter samples over
    its own columns and spreads q over the vocabulary once per round: the output is still the
    target's distribution."""
    from angelspec_hf.modeling_angelspec_common import AngelSpecCandidateGenerator

    drafter = drafters(small_target)["dfly-reduced"]
    processors_seen = []
    original = AngelSpecCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        processors_seen.append(self.logits_processor)

    monkeypatch.setattr(AngelSpecCandidateGenerator, "__init__", spy)
    plain = plain_samples(small_target, seed=1, top_k=0)
    speculative, accepted = speculative_samples(small_target, drafter, seed=2, top_k=0)
    assert processors_seen and all(p is None for p in processors_seen), "the processor-free path must run"
    assert accepted > SAMPLES // 4
    assert min_p_value(plain, speculative) > MIN_P_VALUE


def test_sample_tokens_draws_each_token_at_its_probability_and_never_a_zero_one():
    """The CPU sampler (inverse CDF, one uniform a row) against the exact probabilities: a chi-square
    goodness of fit over 60k draws, unnormalised rows, and zero-probability tokens (first, inner,
    last) never drawn; a sampler that draws one token 7% too often fails the same check."""
    from scipy.stats import chisquare

    from angelspec_hf.modeling_angelspec_common import sample_tokens

    torch.manual_seed(11)
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.5, 0.0])
    rows = weights.expand(60_000, -1)
    tokens = sample_tokens(rows)
    assert tokens.shape == (60_000, 1) and tokens.dtype == torch.long
    counts = torch.bincount(tokens[:, 0], minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    expected = (weights / weights.sum() * 60_000)[weights > 0]
    assert chisquare(counts[weights > 0].double().numpy(), expected.double().numpy()).pvalue > 1e-3
    skewed = expected.clone()
    skewed[0], skewed[2] = skewed[0] * 0.32 / 0.30, skewed[2] - skewed[0] * 0.02 / 0.30
    assert chisquare(counts[weights > 0].double().numpy(), skewed.double().numpy()).pvalue < 1e-3


@pytest.mark.parametrize("settings, in_columns", [
    ({"temperature": 0.7, "top_k": 6, "top_p": 0.9}, True),
    ({"temperature": 0.7, "repetition_penalty": 1.5}, False),
], ids=["warpers-in-columns", "repetition-penalty-spread"])
def test_a_reduced_drafter_warps_its_columns_unless_a_processor_reads_ids(small_target, monkeypatch, settings, in_columns):
    """Temperature, top-k and top-p warp the draft vocabulary's own columns (no spread to the full
    vocabulary per drafted position); a repetition penalty, which indexes the vocabulary by the ids,
    gets every position spread first. Both keep the target's distribution."""
    from angelspec_hf.modeling_angelspec_common import BatchedDraft

    modes = []
    original = BatchedDraft.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        modes.append((self.in_draft_columns, self.spread_each_step))

    monkeypatch.setattr(BatchedDraft, "__init__", spy)
    drafter = drafters(small_target)["dfly-reduced"]
    plain = plain_samples(small_target, seed=1, **settings)
    speculative, accepted = speculative_samples(small_target, drafter, seed=2, **settings)
    assert set(modes) == {(in_columns, not in_columns)}
    assert accepted > SAMPLES // 4
    assert min_p_value(plain, speculative) > MIN_P_VALUE


def test_picking_a_row_kernel_leaves_the_seeded_random_stream_alone(small_target, monkeypatch):
    """The first drafted round of a process times the one-row kernels; that must not draw from the
    global generator, or a seeded sampled ``generate`` would give other text the first time."""
    from angelspec_hf import modeling_angelspec_common as common

    monkeypatch.undo()
    monkeypatch.setattr(common, "_ROW_KERNELS", {})
    drafter = drafters(small_target)["dfly"]

    def seeded_run():
        torch.manual_seed(3)
        out = small_target.generate(PROMPT, assistant_model=drafter, do_sample=True, max_new_tokens=12,
                                    eos_token_id=None)
        return out, torch.rand(4)

    first, after_first = seeded_run()
    assert common._ROW_KERNELS, "the first run must have timed the kernels"
    second, after_second = seeded_run()
    assert torch.equal(first, second)
    assert torch.equal(after_first, after_second)
