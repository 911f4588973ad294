"""Training losses against hand-computed values."""

import math

import pytest
import torch

from angelspec_hf.training import losses

P = torch.log(torch.tensor([[0.5, 0.5]]))
Q = torch.log(torch.tensor([[0.25, 0.75]]))


def test_forward_kl_tv_and_acceptance():
    assert losses.forward_kl(P, Q).item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    assert losses.total_variation(P, Q).item() == pytest.approx(0.25, abs=1e-6)
    assert losses.acceptance_probability(P, Q).item() == pytest.approx(0.75, abs=1e-6)
    assert losses.forward_kl(P, P).item() == pytest.approx(0.0, abs=1e-7)


def test_lk_loss_uses_adaptive_lambda():
    loss, alpha = losses.lk_loss(P, Q, eta=3.0)
    kl, tv = 0.5 * math.log(2) + 0.5 * math.log(2 / 3), 0.25
    weight = math.exp(-3.0 * 0.75)
    assert alpha.item() == pytest.approx(0.75, abs=1e-6)
    assert loss.item() == pytest.approx(weight * kl + (1 - weight) * tv, abs=1e-6)


def test_lambda_is_not_differentiated():
    q = Q.clone().requires_grad_(True)
    loss, _ = losses.lk_loss(P, q, eta=3.0)
    loss.sum().backward()
    q2 = Q.clone().requires_grad_(True)
    weight = math.exp(-3.0 * 0.75)
    (weight * losses.forward_kl(P, q2) + (1 - weight) * losses.total_variation(P, q2)).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)


def test_end_to_end_tv_loss_and_expected_length():
    alphas = torch.tensor([0.5, 0.8, 0.5])
    assert losses.end_to_end_tv_loss(alphas).item() == pytest.approx(1 - (0.5 + 0.4 + 0.2) / 3)
    assert losses.expected_accepted_length(alphas).item() == pytest.approx(1.1)


def test_dpace_weights_and_position_decay():
    weights = losses.dpace_weights(torch.tensor([1.0, 0.0, 0.5], requires_grad=True), smoothing=0.5)
    torch.testing.assert_close(weights, torch.tensor([1.875, 0.875, 0.375]))
    assert not weights.requires_grad
    torch.testing.assert_close(losses.position_decay(3, 0.5), torch.tensor([1.0, 0.5, 0.25]))


def test_chunking_does_not_change_results(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    p, q = torch.randn(3, 5, 40, generator=generator), torch.randn(3, 5, 40, generator=generator)
    q.requires_grad_(True)

    def results():
        values = [losses.forward_kl(p, q), losses.total_variation(p, q), *losses.lk_loss(p, q)]
        (gradient,) = torch.autograd.grad(sum(value.sum() for value in values), q)
        return [value.detach() for value in values] + [gradient]

    full = results()
    monkeypatch.setattr(losses, "CHUNK_ROWS", 4)
    chunked = results()
    for a, b in zip(full, chunked):
        assert a.shape == ((3, 5, 40) if a is full[-1] else (3, 5))
        torch.testing.assert_close(a, b)


def test_reduced_vocabulary_minus_infinity_is_finite_where_target_has_no_mass():
    p = torch.log(torch.tensor([[0.0, 0.4, 0.6]]))
    q = torch.tensor([[float("-inf"), 0.0, 0.0]])
    assert torch.isfinite(losses.forward_kl(p, q)).all()
    assert losses.total_variation(p, q).item() == pytest.approx(0.1, abs=1e-6)


def _logit_family(family: str):
    """A tiny target whose forward transforms ``lm_head`` of its final state (sharpened, so it shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"cohere": {}, "granite": {"logits_scaling": 8.0}, "gemma2": {"final_logit_softcapping": 3.0}}[family]
    config = AutoConfig.for_model(family, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(30.0)
    return target


@pytest.mark.parametrize("family", ["cohere", "granite", "gemma2"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
def test_soft_labels_are_the_targets_own_distribution(family, reduced):
    """Cohere scales, Granite divides and Gemma 2 caps the logits after ``lm_head``: the soft labels
    built from the final state must do the same, or the drafter learns another distribution."""
    from angelspec_hf import MTPDrafter

    target = _logit_family(family)
    ids = torch.arange(3, 40)[None]
    kept = torch.arange(0, 96, 2) if reduced else None
    drafter = MTPDrafter.from_target(target, draft_token_ids=kept)
    final = target.base_model(input_ids=ids).last_hidden_state
    expected = target(input_ids=ids).logits
    expected = expected[..., kept] if reduced else expected
    transform = losses.target_logit_transform(target.config)
    labels = losses.target_vocabulary_logits(drafter, target.get_output_embeddings(), final, transform)
    torch.testing.assert_close(labels.softmax(-1), expected.softmax(-1), atol=1e-5, rtol=1e-4)
    untransformed = losses.target_vocabulary_logits(drafter, target.get_output_embeddings(), final)
    assert (untransformed.softmax(-1) - expected.softmax(-1)).abs().max() > 0.05
    assert losses.check_target_logits(target, transform, ids[:, :8]) < 1e-4


def test_an_unknown_logit_transform_is_warned_about(caplog):
    target = _logit_family("cohere")
    with caplog.at_level("WARNING"):
        assert losses.check_target_logits(target, None, torch.arange(3, 11)[None]) > 1.0
    assert "differ from cohere's logits" in caplog.text


def test_the_trainer_builds_labels_through_the_targets_transform(tmp_path, monkeypatch):
    from angelspec_hf.training import trainer
    from angelspec_hf.training.recipes import Recipe, train_drafter

    target = _logit_family("granite")
    seen = []
    chain_loss = trainer.chain_loss

    def recorded(*args, target_transform=None, **kwargs):
        seen.append(target_transform)
        return chain_loss(*args, target_transform=target_transform, **kwargs)

    monkeypatch.setattr(trainer, "chain_loss", recorded)
    rows = [{"input_ids": list(range(3 + i, 23 + i)), "loss_start": 4} for i in range(4)]
    recipe = Recipe(name="mtp-chat", lk_steps=2, tv_steps=0, batch_size=2, logging_steps=1)
    train_drafter(target, rows, tmp_path, recipe, pad_token_id=0)
    logits = torch.tensor([16.0, -8.0])
    assert seen and all(torch.equal(transform(logits), logits / 8.0) for transform in seen)
