"""Exact verification: a position gets the same bits alone and inside a verify forward, in bfloat16."""

import copy

import pytest
import torch
import torch.nn.functional as F

from angelspec_hf import MTPDrafter
from angelspec_hf.errors import ExactVerificationError
from angelspec_hf.generation import exact
from angelspec_hf.generation.exact import (
    ATTENTION_NAME,
    check_verification_exact,
    exact_attention,
    is_verification_exact,
    make_verification_exact,
    plan_linear,
)
from conftest import FAMILIES, PROMPT_LENGTH


class _Attention(torch.nn.Module):
    is_causal = True


def _reference_attention(query, key, value, mask):
    """float64 softmax(q k^T / sqrt(d) + mask) v with GQA, for comparison."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    scores = query.double() @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).nan_to_num(0.0) @ value).transpose(1, 2)


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 70), (5, 5), (9, 130), (3, 64)])
def test_exact_attention_computes_causal_attention(q_len, kv_len):
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, q_len, 8), torch.randn(2, 3, kv_len, 8), torch.randn(2, 3, kv_len, 8)
    out, weights = exact_attention(_Attention(), query, key, value, None)
    causal = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
    assert weights is None and out.shape == (2, q_len, 6, 8)
    torch.testing.assert_close(out.double(), _reference_attention(query, key, value, causal), atol=1e-5, rtol=1e-5)


def test_exact_attention_follows_a_padding_mask_and_zeroes_rows_that_see_nothing():
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.ones(2, 1, 3, 7, dtype=torch.bool).tril(4)
    mask[0, :, :, :2] = False  # left padding of the first sequence
    mask[1, :, 0] = False  # a query that sees no key
    out, _ = exact_attention(_Attention(), query, key, value, mask)
    assert torch.isfinite(out).all() and torch.equal(out[1, 0], torch.zeros(4, 8))
    torch.testing.assert_close(out.double(), _reference_attention(query, key, value, mask[:, 0][:, None]), atol=1e-5, rtol=1e-5)


def test_exact_attention_follows_a_mask_updated_in_place_between_forwards():
    """The per-forward mask bias is kept for the next layer of the same forward; a caller that
    updates its mask in place (the same object) must not get the old bias."""
    torch.manual_seed(3)
    query, key, value = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.ones(2, 1, 3, 7, dtype=torch.bool).tril(4)
    exact_attention(_Attention(), query, key, value, mask)
    mask[0, :, :, :3] = False
    out, _ = exact_attention(_Attention(), query, key, value, mask)
    torch.testing.assert_close(out.double(), _reference_attention(query, key, value, mask[:, 0][:, None]), atol=1e-5, rtol=1e-5)


def test_exact_attention_rows_do_not_depend_on_other_rows_or_later_keys():
    torch.manual_seed(2)
    query = torch.randn(1, 6, 9, 16).bfloat16()
    key, value = torch.randn(1, 3, 200, 16).bfloat16(), torch.randn(1, 3, 200, 16).bfloat16()
    together, _ = exact_attention(_Attention(), query, key, value, None)
    for row in range(9):
        seen = 200 - 9 + row + 1
        alone, _ = exact_attention(_Attention(), query[:, :, row:row + 1], key[:, :, :seen], value[:, :, :seen], None)
        assert torch.equal(alone[:, 0], together[:, row]), row


def test_exact_attention_refuses_what_it_does_not_implement():
    query = key = value = torch.randn(1, 2, 3, 4)
    with pytest.raises(ExactVerificationError, match="softcap"):
        exact_attention(_Attention(), query, key, value, None, softcap=30.0)
    training = _Attention().train()
    with pytest.raises(ExactVerificationError, match="dropout"):
        exact_attention(training, query, key, value, None, dropout=0.1)


def _row_dependent_linear(threshold_rows, single_offset, mixed_offset=0.0):
    """F.linear whose results change with the row count, as some BLAS paths do in the last bits
    (on top of an elementwise product and sum, which gives every row the same bits by itself)."""

    def linear(x, weight, bias=None):
        out = (x.unsqueeze(-2) * weight).sum(-1)
        out = out if bias is None else out + bias
        rows = x.numel() // x.shape[-1]
        if rows == 1 and single_offset:
            return out + single_offset
        if rows > threshold_rows:
            return out + 1e-3
        flat = x.reshape(rows, x.shape[-1])
        if mixed_offset and not torch.equal(flat, flat[:1].expand_as(flat)):
            return out + mixed_offset
        return out

    return linear


def test_plan_linear_finds_the_row_counts_that_agree(monkeypatch):
    weight = torch.randn(12, 8)
    monkeypatch.setattr(F, "linear", _row_dependent_linear(threshold_rows=6, single_offset=0.0))
    assert plan_linear(weight, None, max_rows=6) == exact.RowPlan(pad_single=False, largest_block=6)
    monkeypatch.setattr(F, "linear", _row_dependent_linear(threshold_rows=4, single_offset=1e-3))
    plan = plan_linear(weight, None, max_rows=6)
    assert plan == exact.RowPlan(pad_single=True, largest_block=4)
    monkeypatch.setattr(F, "linear", _row_dependent_linear(threshold_rows=6, single_offset=0.0, mixed_offset=1e-3))
    with pytest.raises(ExactVerificationError, match="float32"):
        plan_linear(weight, None, max_rows=6)


def test_rerouted_linear_keeps_every_row_on_agreeing_row_counts(monkeypatch):
    target = copy.deepcopy(_tiny_bf16("llama"))
    monkeypatch.setattr(F, "linear", _row_dependent_linear(threshold_rows=3, single_offset=1e-2))
    state = make_verification_exact(target, max_rows=8, check=False)
    assert state.plans and all(plan == exact.RowPlan(True, 3) for plan in state.plans.values())
    name = next(iter(state.plans))
    layer = dict(target.named_modules())[name]
    x = torch.randn(1, 7, layer.in_features).bfloat16()
    rows = [layer(x[:, i:i + 1]) for i in range(7)]
    assert torch.equal(layer(x), torch.cat(rows, dim=1))
    assert layer(x[:, :0]).shape == (1, 0, layer.out_features)  # no rows: nothing to split
    # A copy's rerouted layers use the copy's weights.
    twin = copy.deepcopy(target)
    with torch.no_grad():
        dict(twin.named_modules())[name].weight.zero_()
    assert not torch.equal(dict(twin.named_modules())[name](x), layer(x))
    state.undo()
    assert "forward" not in layer.__dict__ and not is_verification_exact(target)
    assert target.config._attn_implementation != ATTENTION_NAME


def _tiny_bf16(family):
    from angelspec_hf.reference import tiny_target

    return tiny_target(family, seed=FAMILIES.index(family)).to(torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_target_verifies_exactly(family):
    target = _tiny_bf16(family)
    state = make_verification_exact(target, max_rows=10)
    assert is_verification_exact(target) and make_verification_exact(target) is state
    assert check_verification_exact(target, 10, contexts=(1, 60, 129)) == {}


def test_a_sliding_window_target_past_its_window_verifies_exactly():
    """The check's cache dropped keys beyond a sliding window (Gemma 3 and 4, Cohere 2, Mistral with
    a window) and then refused to crop them: make_verification_exact raised transformers' RuntimeError
    ("`crop` was called, but the current layer does not track past states")."""
    from angelspec_hf.reference import tiny_target

    target = tiny_target("mistral", sliding_window=8).to(torch.bfloat16)
    make_verification_exact(target, max_rows=6)
    assert check_verification_exact(target, 6, contexts=(3, 40)) == {}
    torch.manual_seed(0)
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3).eval()
    for prompt in ([1, 5, 9, 13, 17, 21, 25], [1, 40, 41]):
        ids = torch.tensor([prompt])
        plain = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        fast = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert torch.equal(plain, fast)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["mtp", "dfly-hybrid-corr"])
def test_bf16_speculative_greedy_is_token_identical(targets, family, kind):
    target = copy.deepcopy(targets.target(family)).to(torch.bfloat16)
    make_verification_exact(target, max_rows=8)
    drafter = copy.deepcopy(targets.fitted(family, kind)).to(torch.bfloat16)
    accepted = 0
    prompts = [row[None] for row in targets.sequences(family)[:4, :PROMPT_LENGTH]]
    for prompt in prompts:
        plain = target.generate(prompt, max_new_tokens=33, do_sample=False, eos_token_id=None)
        fast = target.generate(prompt, assistant_model=drafter, max_new_tokens=33, do_sample=False, eos_token_id=None)
        assert torch.equal(plain, fast), (kind, prompt.tolist())
        accepted += sum(drafter.last_speculation_stats.accepted)
    assert accepted > 0  # drafts were accepted, so multi-token verify forwards decided the output


def test_failed_check_undoes_and_names_the_mismatch(monkeypatch):
    target = _tiny_bf16("llama")
    before = target.config._attn_implementation
    monkeypatch.setattr(exact, "check_verification_exact", lambda *args, **kwargs: {(250, 9): [3]})
    with pytest.raises(ExactVerificationError, match=r"\(250, 9\)"):
        make_verification_exact(target)
    assert not is_verification_exact(target) and target.config._attn_implementation == before


def test_exact_target_saves_a_loadable_config(tmp_path):
    from transformers import AutoModelForCausalLM

    target = _tiny_bf16("llama")
    make_verification_exact(target, max_rows=4)
    target.save_pretrained(tmp_path)
    assert ATTENTION_NAME not in (tmp_path / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation != ATTENTION_NAME


def test_an_attention_feature_the_exact_kernels_refuse_undoes_everything():
    """Gemma 2's soft-capping is refused on the check's first forward; the target kept the exact
    attention installed after that error."""
    from angelspec_hf.reference import tiny_target

    target = tiny_target("gemma2").to(torch.bfloat16)
    before = target.config._attn_implementation
    with pytest.raises(ExactVerificationError, match="softcap"):
        make_verification_exact(target, max_rows=4)
    assert not is_verification_exact(target) and target.config._attn_implementation == before
    target.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)


def test_a_layer_that_cannot_be_made_exact_undoes_everything(monkeypatch):
    target = _tiny_bf16("qwen3")
    before = target.config._attn_implementation
    monkeypatch.setattr(F, "linear", _row_dependent_linear(threshold_rows=16, single_offset=0.0, mixed_offset=1e-2))
    with pytest.raises(ExactVerificationError, match="float32"):
        make_verification_exact(target, max_rows=4)
    assert not is_verification_exact(target) and target.config._attn_implementation == before
    assert not any("forward" in module.__dict__ for module in target.modules())
