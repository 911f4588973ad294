"""Targets beyond Llama and Qwen3: older configs, projected embeddings, column-counted positions,
heterogeneous configs and KV-shared layers (Gemma 4).

Found by building drafters for tiny random targets of 29 `transformers` families (session 46): every
one either works (token-identical to plain `generate`) or now stops with an error naming why.
"""

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, MptConfig, MptForCausalLM,
                          OPTConfig, OPTForCausalLM)

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.errors import DrafterConfigError, UnsupportedCacheError
from angelspec_hf.generation.engine import SpeculativeEngine

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 7, 3], [1, 40, 41, 42, 43]]


def sharpened(model):
    """Random heads give near-ties that batched and unbatched forwards may break differently."""
    torch.manual_seed(0)
    model = model.eval().requires_grad_(False)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def gpt2():
    torch.manual_seed(0)
    return sharpened(GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=4, n_head=4, n_positions=512,
                                                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)))


def plain(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=None, **kwargs)[0].tolist()


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_a_config_without_intermediate_size_gets_a_drafter_that_decodes_exactly(kind):
    """GPT-2's config has no ``intermediate_size`` (its MLP is four times the hidden size):
    ``from_target`` raised AttributeError."""
    target = gpt2()
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3) if kind == "mtp" else DFlyDrafter.from_target(target, block_size=4)
    assert drafter.config.intermediate_size == 4 * 64
    for prompt in PROMPTS:
        out = target.generate(torch.tensor([prompt]), assistant_model=drafter, do_sample=False, max_new_tokens=16,
                              eos_token_id=None)
        assert out[0].tolist() == plain(target, prompt)
    outputs = SpeculativeEngine(target, drafter, max_batch_size=2).generate(PROMPTS, max_new_tokens=16)
    assert outputs == [plain(target, prompt) for prompt in PROMPTS]


def test_projected_embeddings_are_refused_by_name():
    target = OPTForCausalLM(OPTConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=128, word_embed_proj_dim=32, max_position_embeddings=512))
    with pytest.raises(DrafterConfigError, match="projects its embeddings.*'input embeddings': 32.*hidden size 64"):
        MTPDrafter.from_target(target)


def test_column_counted_alibi_is_refused_by_the_engine_and_decodes_through_generate():
    """MPT biases keys by their cache column: the engine gave other text than `generate` for 2 of 4
    prompts. Its config also turns the cache off, which the error about it now says."""
    target = sharpened(MptForCausalLM(MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=512)))
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3)
    with pytest.raises(UnsupportedCacheError, match="ALiBi position biases count cache columns"):
        SpeculativeEngine(target, drafter)
    with pytest.raises(UnsupportedCacheError, match="generation config, as MPT's is.*use_cache=True"):
        target.generate(torch.tensor([PROMPTS[0]]), assistant_model=drafter, max_new_tokens=4)
    for prompt in PROMPTS:
        out = target.generate(torch.tensor([prompt]), assistant_model=drafter, do_sample=False, max_new_tokens=16,
                              eos_token_id=None, use_cache=True)
        assert out[0].tolist() == plain(target, prompt, use_cache=True)


def gemma4(**overrides):
    """Gemma 4's text model: its full-attention layers have their own ``head_dim`` (a heterogeneous
    config, which raises on reading ``head_dim`` for the whole model), and with ``num_kv_shared_layers``
    its last layers read earlier layers' keys and values instead of caching their own."""
    config = AutoConfig.for_model("gemma4_text", vocab_size=96, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, sliding_window=8, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, tie_word_embeddings=False,
                                  layer_types=["sliding_attention", "full_attention"] * 3, **overrides)
    torch.manual_seed(0)
    return sharpened(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
@pytest.mark.parametrize("shared", [0, 2], ids=["own-kv", "kv-shared"])
def test_gemma4_gets_drafters_that_decode_exactly_in_generate_and_the_engine(kind, shared):
    """`from_target` raised AmbiguousGlobalPerLayerAttributeError on Gemma 4 (it read ``head_dim`` of
    the whole config), and the engine refused KV-shared layers as unknown ("dummy") layers. The
    sliding window of 8 is shorter than the 24-token outputs, so the engine's window masks count."""
    target = gemma4(num_kv_shared_layers=shared)
    assert target.config.is_heterogeneous
    prompts = PROMPTS + [[1, 8]]
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3) if kind == "mtp" else DFlyDrafter.from_target(target, block_size=4)
    assert drafter.config.head_dim == 16  # the first (sliding) layer's, not the full-attention layers' 512
    expected = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24, eos_token_id=None)[0].tolist()
                for p in prompts]
    for prompt, reference in zip(prompts, expected):
        out = target.generate(torch.tensor([prompt]), assistant_model=drafter.eval(), do_sample=False,
                              max_new_tokens=24, eos_token_id=None)
        assert out[0].tolist() == reference
    assert SpeculativeEngine(target, drafter, max_batch_size=2).generate(prompts, max_new_tokens=24, eos_token_id=[]) == expected
    assert SpeculativeEngine(target, None, max_batch_size=2).generate(prompts, max_new_tokens=24, eos_token_id=[]) == expected
