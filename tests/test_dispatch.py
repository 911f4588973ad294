"""The generate integration only takes over for our drafters; everything else runs as before."""

import pytest
import torch
from transformers.generation.utils import GenerationMixin

import angelspec_hf
from angelspec_hf.modeling_angelspec_common import _DISPATCH_MARK
from angelspec_hf.reference import tiny_target
from conftest import PROMPT_LENGTH


def test_installing_twice_keeps_one_layer():
    before = GenerationMixin._get_candidate_generator
    angelspec_hf.install_generate_integration()
    assert GenerationMixin._get_candidate_generator is before
    assert getattr(before, _DISPATCH_MARK)


def test_prompt_lookup_still_works(targets):
    target = targets.target("llama")
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH + 20]
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    lookup = target.generate(prompt, prompt_lookup_num_tokens=4, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(plain, lookup)


@pytest.mark.parametrize("do_sample", [False, True])
def test_ordinary_assistant_model_still_works(targets, do_sample):
    target = targets.target("llama")
    assistant = tiny_target("llama", num_hidden_layers=1, seed=5)
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    torch.manual_seed(0)
    out = target.generate(prompt, assistant_model=assistant, max_new_tokens=12, do_sample=do_sample, eos_token_id=None)
    assert out.shape[1] == PROMPT_LENGTH + 12
    if not do_sample:
        assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None))
