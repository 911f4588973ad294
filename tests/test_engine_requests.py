"""What the engine takes from a request, what it refuses (alone, by name), and that it is left idle
for the next session however a session ends."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from angelspec_hf import MTPDrafter
from angelspec_hf.generation.engine import EngineRequestError, SpeculativeEngine
from angelspec_hf.reference import tiny_target

GOOD = [5, 9, 13]


def plain(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), do_sample=False, **kwargs)[0].tolist()


def served(engine, requests: dict) -> dict:
    """Submit ``{prompt tuple: max_new_tokens}``, step until done; prompt -> full output."""
    ids = {engine.submit(list(prompt), max_new_tokens=count, eos_token_id=[]): prompt for prompt, count in requests.items()}
    out = {request: list(prompt) for request, prompt in ids.items()}
    while engine.has_work:
        for event in engine.step():
            out[event.request] += event.tokens
    return {ids[request]: tokens for request, tokens in out.items()}


def position_limited(target):
    """Positions every forward of ``target`` was given, most first."""
    seen = []
    target.register_forward_pre_hook(lambda module, args, kwargs: seen.append(int(kwargs["position_ids"].max())),
                                     with_kwargs=True)
    return seen


def test_no_slot_is_given_a_position_past_the_targets_on_learned_positions():
    """A request ending at GPT-2's last position beside a drafting row: the wider window's padding slots
    went past it and the position lookup raised IndexError, losing every request of the batch."""
    torch.manual_seed(0)
    target = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                        bos_token_id=1, eos_token_id=2)).eval().requires_grad_(False)
    engine = SpeculativeEngine(target, MTPDrafter.from_target(target, num_draft_tokens=3), max_batch_size=4)
    long_prompt = tuple((7 * i) % 90 + 3 for i in range(54))  # 54 + 10 = 64 positions: allowed
    seen = position_limited(target)
    outputs = served(engine, {long_prompt: 10, tuple(GOOD): 40})
    assert max(seen) < 64 and not engine.has_work
    for prompt, count in ((long_prompt, 10), (tuple(GOOD), 40)):
        assert outputs[prompt] == plain(target, list(prompt), max_new_tokens=count, eos_token_id=None)


def test_a_row_near_the_end_of_a_dynamic_rope_target_leaves_the_other_rows_plain():
    """Dynamic RoPE rescales every row's frequencies from the largest position in the forward, so one
    row's padding slots past the limit changed the other rows' tokens."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0})).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(101)
    shorts = [tuple(torch.randint(3, 96, (n,), generator=generator).tolist()) for n in (12, 9, 15)]
    long_prompt = tuple((7 * i) % 90 + 3 for i in range(50))  # 50 + 14 = 64
    seen = position_limited(target)
    engine = SpeculativeEngine(target, MTPDrafter.from_target(target, num_draft_tokens=8), max_batch_size=4)
    outputs = served(engine, {long_prompt: 14, **{prompt: 40 for prompt in shorts}})
    assert max(seen) < 64
    for prompt in shorts:
        assert outputs[prompt] == plain(target, list(prompt), max_new_tokens=40, eos_token_id=None)


@pytest.mark.parametrize("bad", [[[5, 9, 13]], torch.tensor([[5, 9, 13]]), None, "hello", [5.7, 9.2], [5, [9]]])
def test_a_prompt_that_is_not_one_sequence_of_int_ids_fails_alone(bad):
    target = tiny_target("llama", seed=4)
    outputs = SpeculativeEngine(target, None, max_batch_size=4).generate([GOOD, bad, GOOD], max_new_tokens=5,
                                                                         eos_token_id=[])
    assert outputs[0] == outputs[2] == plain(target, GOOD, max_new_tokens=5, eos_token_id=None)
    assert isinstance(outputs[1], EngineRequestError) and "token ids (ints)" in str(outputs[1])


@pytest.mark.parametrize("count", [0, -3, 2.5, None, "8", True])
def test_max_new_tokens_must_be_a_count_of_at_least_one(count):
    engine = SpeculativeEngine(tiny_target("llama", seed=4), None, max_batch_size=4)
    with pytest.raises(EngineRequestError, match="max_new_tokens must be an integer of at least 1"):
        engine.submit(GOOD, max_new_tokens=count)
    assert not engine.has_work
    assert [isinstance(out, EngineRequestError) for out in engine.generate([GOOD, GOOD], max_new_tokens=count)] == [True] * 2
    assert engine.generate([GOOD], max_new_tokens=np.int64(2), eos_token_id=[])[0][3:] != []


def test_stream_leaves_the_engine_idle_when_the_caller_stops_early():
    engine = SpeculativeEngine(tiny_target("llama", seed=4), None, max_batch_size=1)
    for event in engine.stream([GOOD, GOOD, GOOD], max_new_tokens=8, eos_token_id=[]):
        break
    del event
    assert not engine.has_work  # before, the queued requests refused every later session
    assert len(engine.generate([GOOD], max_new_tokens=3, eos_token_id=[])[0]) == len(GOOD) + 3


def test_eos_as_generate_takes_it_and_the_targets_by_default():
    target = tiny_target("llama", seed=4)
    free = plain(target, GOOD, max_new_tokens=12, eos_token_id=None)
    eos = free[len(GOOD) + 2]  # a token the row produces: it must stop there
    expected = free[: free.index(eos, len(GOOD)) + 1]
    engine = SpeculativeEngine(target, None, max_batch_size=2)
    for form in (eos, [eos], np.int64(eos), torch.tensor(eos), torch.tensor([eos])):
        assert engine.generate([GOOD], max_new_tokens=12, eos_token_id=form) == [expected], form
    target.generation_config.eos_token_id = eos
    assert engine.generate([GOOD], max_new_tokens=12) == [plain(target, GOOD, max_new_tokens=12)] == [expected]
    assert engine.generate([GOOD], max_new_tokens=12, eos_token_id=[]) == [free]


def test_prompts_may_be_any_iterable_and_bad_engine_settings_are_refused_by_name():
    target = tiny_target("llama", seed=4)
    engine = SpeculativeEngine(target, None, max_batch_size=2)
    outputs = engine.generate((p for p in [GOOD, [7, 8, 9]]), max_new_tokens=3, eos_token_id=[])
    assert outputs == [plain(target, p, max_new_tokens=3, eos_token_id=None) for p in (GOOD, [7, 8, 9])]
    for size in (0, -1, 2.0):
        with pytest.raises(ValueError, match="max_batch_size"):
            SpeculativeEngine(target, None, max_batch_size=size)
    for layers in ([99], [-1]):
        with pytest.raises(ValueError, match=r"capture_layers are decoder-layer indices 0\.\.5"):
            engine.generate([GOOD], max_new_tokens=3, capture_layers=layers)
        assert not engine.has_work


@pytest.mark.parametrize("drafted", [False, True])
def test_stop_strings_end_each_request_as_generate_ends_it(drafted):
    """Per-request stop strings, matched on the text as transformers' StopStringCriteria matches them
    (the completing token kept), so each row is `target.generate(stop_strings=..., tokenizer=...)`'s,
    drafts accepted past the stop or not; a request without them runs on."""
    from tokenizers import decoders

    from fitting import tiny_tokenizer

    target, tokenizer = tiny_target("llama", seed=4), tiny_tokenizer()
    # Stop strings are matched on the tokens' bytes; the word-level test tokenizer's ids are ASCII words.
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    prompts = [GOOD, [7, 8, 9, 10], [30, 31]]
    free = [plain(target, p, max_new_tokens=20, eos_token_id=None) for p in prompts]
    stops = [tokenizer.convert_ids_to_tokens(out[len(p) + 4]) for p, out in zip(prompts, free)]
    expected = [plain(target, p, max_new_tokens=20, eos_token_id=None, stop_strings=stop, tokenizer=tokenizer)
                for p, stop in zip(prompts, stops)]
    assert all(len(e) < len(f) for e, f in zip(expected, free))
    drafter = MTPDrafter.from_target(target, num_draft_tokens=4) if drafted else None
    engine = SpeculativeEngine(target, drafter, max_batch_size=3, tokenizer=tokenizer)
    ids = [engine.submit(p, max_new_tokens=20, eos_token_id=[], stop_strings=stop) for p, stop in zip(prompts, stops)]
    ids.append(engine.submit(GOOD, max_new_tokens=20, eos_token_id=[]))
    out = {i: [] for i in ids}
    while engine.has_work:
        for event in engine.step():
            out[event.request] += event.tokens
    assert [p + out[i] for p, i in zip(prompts, ids)] == expected
    assert GOOD + out[ids[-1]] == free[0]
    assert engine.generate(prompts, max_new_tokens=20, eos_token_id=[], stop_strings=stops[0])[0] == expected[0]
    with pytest.raises(EngineRequestError, match="tokenizer="):
        SpeculativeEngine(target, None).submit(GOOD, stop_strings="w5")
