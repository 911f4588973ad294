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
