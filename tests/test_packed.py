"""Packed float32 linears (generation/packed.py): same results as the stock layers to float32
rounding, stock kernels for one row and for training, and speculative output unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F

from angelspec_hf.generation import SpeculativeEngine, make_verification_exact, pack_linear_weights
from angelspec_hf.generation.packed import PackedLinearError, is_packed, packing_available
from angelspec_hf.reference import tiny_target

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN packed linear")


def linear_layers(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_packed_layers_agree_with_the_stock_ones_and_keep_them_for_one_row():
    target = tiny_target("llama", seed=0)
    layer = linear_layers(target)[0]
    rows, row = torch.randn(7, layer.in_features), torch.randn(1, layer.in_features)
    with torch.no_grad():
        expected_rows, expected_row = F.linear(rows, layer.weight), F.linear(row, layer.weight)
        state = pack_linear_weights(target)
        assert is_packed(target) and len(state.names) == len(linear_layers(target))
        assert layer.forward.__func__.__name__ == "_packed_linear"
        torch.testing.assert_close(layer(rows), expected_rows, rtol=1e-5, atol=1e-6)
        assert torch.equal(layer(row), expected_row)  # one row: the stock kernel, bit for bit
        assert pack_linear_weights(target) is state  # idempotent
    state.undo()
    assert not is_packed(target) and "forward" not in layer.__dict__


def test_a_changed_weight_is_packed_again_and_training_uses_the_stock_layers():
    target = tiny_target("llama", seed=0)
    pack_linear_weights(target)
    layer = linear_layers(target)[0]
    rows = torch.randn(3, layer.in_features)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the stale packed copy must not be used
        torch.testing.assert_close(layer(rows), F.linear(rows, layer.weight), rtol=1e-5, atol=1e-6)
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # replaced
        torch.testing.assert_close(layer(rows), F.linear(rows, layer.weight), rtol=1e-5, atol=1e-6)
    layer(rows).sum().backward()  # with gradients the stock layer runs, so autograd works
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def _same_memory_new_values(weight: torch.Tensor) -> torch.nn.Parameter:
    """A new parameter at ``weight``'s address and version holding other values: what a replaced
    weight can look like when the allocator hands the freed block to the new one. The write goes
    through a NumPy view, which PyTorch's version counter does not see, so ``weight`` keeps its
    version; the new one is brought to it by adding zero in place."""
    memory = weight.detach().numpy()
    memory *= -2.0
    replacement = torch.nn.Parameter(torch.from_numpy(memory), requires_grad=weight.requires_grad)
    with torch.no_grad():
        while replacement._version < weight._version:
            replacement.add_(0.0)
    assert replacement.data_ptr() == weight.data_ptr() and replacement._version == weight._version
    return replacement


def test_a_weight_replaced_at_the_same_address_and_version_is_packed_again():
    """A data pointer and version alone would match the old packed copy and verify with stale
    weights; the weight's identity tells them apart. So does a ``.data`` swap, which keeps both the
    object and its version."""
    target = tiny_target("llama", seed=0)
    pack_linear_weights(target)
    layer = linear_layers(target)[0]
    rows = torch.randn(3, layer.in_features)
    with torch.no_grad():
        layer(rows)  # packed
        layer.weight = _same_memory_new_values(layer.weight)
        torch.testing.assert_close(layer(rows), F.linear(rows, layer.weight), rtol=1e-5, atol=1e-6)
        layer.weight.data = torch.randn_like(layer.weight)  # the same object and version, other memory
        torch.testing.assert_close(layer(rows), F.linear(rows, layer.weight), rtol=1e-5, atol=1e-6)


def test_packing_refuses_what_it_cannot_speed_up():
    with pytest.raises(PackedLinearError, match="float32 targets on a CPU"):
        pack_linear_weights(tiny_target("llama", seed=0).to(torch.bfloat16))
    exact = tiny_target("llama", seed=0)
    make_verification_exact(exact, max_rows=4, check=False)
    with pytest.raises(PackedLinearError, match="exact verification"):
        pack_linear_weights(exact)


def test_a_packed_target_can_be_deep_copied():
    """oneDNN's packed tensors cannot be copied: they live beside the model, and a copy packs its own."""
    target = tiny_target("llama", seed=0)
    pack_linear_weights(target)
    ids = torch.tensor([[1, 5, 9, 3]])
    twin = copy.deepcopy(target)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, target(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculative_output_on_a_packed_target_equals_plain_decoding(targets, family):
    """Greedy speculative decoding on the packed target equals plain decoding of the stock target
    (a tiny random target has no near-ties), through generate and through the engine."""
    stock = targets.target(family)
    target = copy.deepcopy(stock)
    pack_linear_weights(target)
    prompts = targets.sequences(family)[:4, :6]
    drafters = [targets.fitted(family, "dfly-hybrid-corr"), targets.fitted(family, "mtp")]
    for prompt in prompts:
        prompt = prompt[None]
        plain = stock.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
        for drafter in drafters:
            fast = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter,
                                   max_new_tokens=16, do_sample=False)
            assert torch.equal(plain, fast)
            assert sum(drafter.last_speculation_stats.accepted) > 0
    engine = SpeculativeEngine(target, drafters[0], max_batch_size=4)
    outputs = engine.generate([p.tolist() for p in prompts], max_new_tokens=16)
    for prompt, output in zip(prompts, outputs):
        prompt = prompt[None]
        plain = stock.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                               eos_token_id=None)
        assert output == plain[0].tolist()
