"""The batched engine: every row equals its own plain greedy generate, rows join and leave."""

import copy
from types import SimpleNamespace

import pytest
import torch

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.errors import DrafterTargetMismatchError, UnsupportedCacheError
from angelspec_hf.generation.engine import EngineRequestError, SpeculativeEngine, prefill_groups
from angelspec_hf.reference import tiny_target
from fitting import fit_dfly, fit_mtp, target_sequences

PROMPT = 6


@pytest.fixture(scope="module")
def setup():
    # A sharpened random target: batched and unbatched forwards differ in the last float bits,
    # which must not decide between near-tied tokens in a test about bookkeeping.
    target = tiny_target("llama", seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.requires_grad_(False)
    sequences = target_sequences(target, 12, PROMPT, 40, seed=1)
    torch.manual_seed(0)
    drafters = {
        "dfly": fit_dfly(DFlyDrafter.from_target(target, block_size=5), target, sequences, PROMPT, steps=200),
        "mtp": fit_mtp(MTPDrafter.from_target(target, num_draft_tokens=3), target, sequences, PROMPT, steps=200),
        "mtp-deepseek": fit_mtp(MTPDrafter.from_target(target, num_draft_tokens=3, layer_style="deepseek"), target,
                                sequences, PROMPT, steps=200),
    }
    generator = torch.Generator().manual_seed(4)
    prompts = [sequences[i, :PROMPT].tolist() for i in range(5)]
    prompts += [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (3, 9, 14)]
    return target, drafters, prompts


def plain(target, prompt, **kwargs):
    return target.generate(torch.tensor([prompt]), do_sample=False, **kwargs)[0].tolist()


@pytest.mark.parametrize("name", [None, "dfly", "mtp", "mtp-deepseek"])
@pytest.mark.parametrize("max_batch_size", [1, 3, 16])
def test_every_row_equals_its_plain_generate(setup, name, max_batch_size):
    target, drafters, prompts = setup
    engine = SpeculativeEngine(target, drafters.get(name), max_batch_size=max_batch_size)
    outputs = engine.generate(prompts, max_new_tokens=25, eos_token_id=[])
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=25, eos_token_id=None)
    # Dead columns (rows that left, drafts everyone rejected) are dropped: the cache never holds
    # more than the longest live row's tokens, whatever the number of steps and joins.
    assert engine.peak_cache_length <= max(map(len, prompts)) + 25 + (2 if max_batch_size == 1 else 25)
    if name is not None:
        accepted = [a for entry in engine.stats for a in entry["accepted"]]
        assert max(accepted) >= 3 and sum(accepted) > len(accepted) // 2, "drafts must really be accepted"
        assert 0 in accepted, "and rejected"


def test_rows_stop_at_their_own_eos_and_length(setup):
    target, drafters, prompts = setup
    free = [plain(target, p, max_new_tokens=20, eos_token_id=None) for p in prompts]
    eos = free[0][PROMPT + 7]
    engine = SpeculativeEngine(target, drafters["dfly"], max_batch_size=4)
    outputs = engine.generate(prompts, max_new_tokens=20, eos_token_id=eos)
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert len(outputs[0]) < len(free[0]) and outputs[0][-1] == eos


@pytest.mark.parametrize("name", [None, "mtp", "dfly"])
def test_captured_states_equal_one_full_forward_of_each_output(setup, name):
    from angelspec_hf.training.features import run_target

    target, drafters, prompts = setup
    free = plain(target, prompts[1], max_new_tokens=20, eos_token_id=None)
    eos = free[PROMPT + 5]
    layers = [0, 1]
    engine = SpeculativeEngine(target, drafters.get(name), max_batch_size=3)
    outputs = engine.generate(prompts, max_new_tokens=20, eos_token_id=eos, capture_layers=layers)
    assert len(outputs[1]) < len(free)  # a row that stopped at its EOS is captured too
    for index, output in enumerate(outputs):
        assert output == plain(target, prompts[index], max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
        features, final = engine.captured_states[index]
        ids = torch.tensor([output])
        expected_features, expected_final = run_target(target, ids, torch.ones_like(ids), layers)
        # Every token, the last one included, as one forward over the whole output gives them.
        assert features.shape == (2, len(output), target.config.hidden_size) and final.shape[0] == len(output)
        torch.testing.assert_close(features, torch.stack(expected_features)[:, 0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(final, expected_final[0], atol=2e-4, rtol=1e-4)


def test_a_bad_request_fails_alone(setup):
    target, drafters, prompts = setup
    engine = SpeculativeEngine(target, drafters["mtp"], max_batch_size=2)
    batch = [prompts[0], [], [5, 10_000], prompts[1], list(range(3, 90)) * 6]
    outputs = engine.generate(batch, max_new_tokens=10)
    assert outputs[0] == plain(target, prompts[0], max_new_tokens=10, eos_token_id=None)
    assert outputs[3] == plain(target, prompts[1], max_new_tokens=10, eos_token_id=None)
    assert isinstance(outputs[1], EngineRequestError) and "Empty prompt" in str(outputs[1])
    assert isinstance(outputs[2], EngineRequestError) and "outside the vocabulary" in str(outputs[2])
    assert isinstance(outputs[4], EngineRequestError) and "exceeds the target's 512 positions" in str(outputs[4])


def test_engine_refuses_a_foreign_drafter_and_a_bad_temperature(setup):
    target, drafters, _ = setup
    with pytest.raises(DrafterTargetMismatchError):
        SpeculativeEngine(tiny_target("llama", seed=5), drafters["dfly"])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SpeculativeEngine(target).generate([[5, 6]], do_sample=True, temperature=0.0)


# Windows shorter than the outputs, so every row's later tokens must not see its first ones. Mistral
# slides in every layer (one mask), Qwen2 in its upper half and Gemma2 in every other layer (a mask per
# layer type; Gemma2 also attends eagerly, so its masks are additive floats).
SLIDING = {
    "mistral": dict(sliding_window=6),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=3),
    "gemma2": dict(sliding_window=6, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(SLIDING))
def sliding_setup(request):
    target = tiny_target(request.param, seed=3, **SLIDING[request.param])
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.requires_grad_(False)
    sequences = target_sequences(target, 12, PROMPT, 40, seed=1)
    torch.manual_seed(0)
    drafter = fit_mtp(MTPDrafter.from_target(target, num_draft_tokens=3), target, sequences, PROMPT, steps=200)
    generator = torch.Generator().manual_seed(4)
    prompts = [sequences[i, :PROMPT].tolist() for i in range(4)]
    prompts += [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (3, 11)]
    return target, drafter, prompts


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "mtp"])
def test_sliding_window_targets_keep_every_row_plain(sliding_setup, drafted):
    """Rows share physical cache columns with other rows and with rejected drafts, so a window over
    columns is not a window over positions: the engine masks by each row's own positions."""
    target, drafter, prompts = sliding_setup
    engine = SpeculativeEngine(target, drafter if drafted else None, max_batch_size=3)
    outputs = engine.generate(prompts, max_new_tokens=25, eos_token_id=[])
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=25, eos_token_id=None)
    if drafted:
        accepted = [a for entry in engine.stats for a in entry["accepted"]]
        assert max(accepted) >= 2 and 0 in accepted, accepted


def test_sliding_window_targets_generate_with_a_drafter_is_plain(sliding_setup):
    """transformers' own assisted loop crops the target's sliding cache layers after a rejection."""
    target, drafter, prompts = sliding_setup
    for prompt in prompts:
        ids = torch.tensor([prompt])
        expected = target.generate(ids, do_sample=False, max_new_tokens=25, eos_token_id=None)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=25,
                                           eos_token_id=None), expected)


def test_engine_names_the_attention_it_cannot_mask():
    target = tiny_target("llama")
    target.config.layer_types = ["full_attention", "chunked_attention"] * 3
    target.config.attention_chunk_size = 8
    with pytest.raises(UnsupportedCacheError, match=r"\['chunked_attention'\].*target.generate\(assistant_model=drafter\)"):
        SpeculativeEngine(target)
    from transformers import Mamba2Config, Mamba2ForCausalLM

    recurrent = Mamba2ForCausalLM(Mamba2Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                                               n_groups=1, state_size=8, chunk_size=16, expand=2))
    with pytest.raises(UnsupportedCacheError, match="recurrent state cannot be rolled back"):
        SpeculativeEngine(recurrent)
    windowed = tiny_target("mistral", sliding_window=6)
    windowed.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(UnsupportedCacheError, match="attn_implementation='sdpa'"):
        SpeculativeEngine(windowed).generate([[5, 6, 7]], max_new_tokens=2)


@pytest.mark.parametrize("name", [None, "dfly", "mtp"])
def test_streamed_tokens_add_up_to_each_plain_generate(setup, name):
    target, drafters, prompts = setup
    engine = SpeculativeEngine(target, drafters.get(name), max_batch_size=3)
    streamed: dict[int, list[int]] = {}
    events_per_request: dict[int, int] = {}
    finished = []
    for event in engine.stream(prompts + [[]], max_new_tokens=20):
        assert event.request not in finished, "nothing after a request's finished event"
        if event.finished:
            finished.append(event.request)
        if event.error is None:
            streamed.setdefault(event.request, []).extend(event.tokens)
            events_per_request[event.request] = events_per_request.get(event.request, 0) + 1
    assert sorted(finished) == list(range(len(prompts) + 1))
    assert finished[0] == len(prompts), "a request that cannot be served fails first, alone"
    for index, prompt in enumerate(prompts):
        assert prompt + streamed[index] == plain(target, prompt, max_new_tokens=20, eos_token_id=None)
        # Tokens arrive step by step, not at the end: at most one window a step (the first step
        # also brings the prefill's token).
        assert events_per_request[index] >= 19 // (1 + (drafters[name].max_draft_tokens if name else 0))


def test_requests_submitted_while_others_decode_join_and_match_plain(setup):
    target, drafters, prompts = setup
    eos = plain(target, prompts[2], max_new_tokens=20, eos_token_id=None)[PROMPT + 6]
    engine = SpeculativeEngine(target, drafters["dfly"], max_batch_size=3)
    first = [engine.submit(prompts[0], max_new_tokens=30), engine.submit(prompts[1], max_new_tokens=12)]
    assert first == [0, 1] and engine.has_work
    outputs = {request: [] for request in first}
    late = {}
    steps = 0
    while engine.has_work:
        for event in engine.step():
            outputs[event.request] += event.tokens
        steps += 1
        if steps == 3:
            # Arrive mid-flight, each with its own length and EOS; one waits for a free slot.
            late = {engine.submit(prompts[i], max_new_tokens=n, eos_token_id=e): (i, n, e)
                    for i, n, e in [(2, 20, eos), (3, 8, None), (4, 25, None)]}
            outputs.update({request: [] for request in late})
            assert all(outputs[request] for request in first), "the first requests were decoding"
    expected = {0: (0, 30, None), 1: (1, 12, None), **late}
    for request, (i, n, e) in expected.items():
        assert prompts[i] + outputs[request] == plain(target, prompts[i], max_new_tokens=n, eos_token_id=e, pad_token_id=0)
    assert outputs[list(late)[0]][-1] == eos and len(outputs[list(late)[0]]) < 20
    assert engine.step() == [] and not engine.has_work


def test_prefill_groups_bound_padding_and_forward_size():
    # Longest first; a prompt joins while the group padded to its longest is within 1.25x its real tokens.
    assert prefill_groups([100, 90, 45, 80, 40]) == [[0, 1, 3], [2, 4]]
    assert prefill_groups([100, 90, 50, 80, 40]) == [[0, 1, 3, 2], [4]]  # 400 padded slots for 320 real ones: at the bound
    assert prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    assert prefill_groups([10, 10, 10], max_tokens=20) == [[0, 1], [2]]
    assert prefill_groups([10, 7], padding=0.0) == [[0], [1]]
    assert prefill_groups([3000, 5]) == [[0], [1]]  # a prompt over the forward size goes alone
    assert prefill_groups([]) == []
    lengths = torch.randint(1, 400, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = prefill_groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(60))
    for group in groups:
        padded = max(lengths[i] for i in group) * len(group)
        assert len(group) == 1 or (padded <= 1.25 * sum(lengths[i] for i in group) and padded <= 2048)


@pytest.mark.parametrize("keeps_logits", [True, False])
def test_joining_prompts_are_prefilled_by_length_and_stay_plain(setup, keeps_logits):
    target, drafters, _ = setup
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (5, 40, 6, 37, 4, 18)]
    engine = SpeculativeEngine(target, drafters["mtp"], max_batch_size=6)
    engine.keeps_logits = keeps_logits  # a target whose forward takes no logits_to_keep
    calls = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((tuple(kwargs["input_ids"].shape), kwargs.get("logits_to_keep"))),
        with_kwargs=True)
    try:
        outputs = engine.generate(prompts, max_new_tokens=12)
    finally:
        hook.remove()
    # One forward per group of similar lengths, each keeping the logits from its shortest prompt's last token on.
    assert calls[:3] == [((2, 40), 4 if keeps_logits else None), ((1, 18), 1 if keeps_logits else None),
                         ((3, 6), 3 if keeps_logits else None)]
    assert calls[3][0][0] == 6, "then every row decodes in one batch"
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=12, eos_token_id=None)


def test_submit_refuses_a_bad_request_and_stream_a_busy_engine(setup):
    target, drafters, prompts = setup
    engine = SpeculativeEngine(target, drafters["mtp"], max_batch_size=2)
    request = engine.submit(prompts[0], max_new_tokens=10)
    with pytest.raises(EngineRequestError, match="outside the vocabulary"):
        engine.submit([5, 10_000])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        engine.submit(prompts[1], do_sample=True, temperature=0.0)
    with pytest.raises(RuntimeError, match="drain them with step"):
        engine.generate([prompts[1]])
    tokens = []
    while engine.has_work:
        tokens += [t for event in engine.step() if event.request == request for t in event.tokens]
    assert prompts[0] + tokens == plain(target, prompts[0], max_new_tokens=10, eos_token_id=None)
    assert engine.generate([prompts[1]], max_new_tokens=5) == [plain(target, prompts[1], max_new_tokens=5, eos_token_id=None)]


@pytest.mark.parametrize("name", ["dfly", "mtp"])
def test_greedy_and_sampled_requests_share_a_batch(name):
    """Each request decodes with its own settings: greedy rows stay identical to plain greedy
    decoding and sampled rows (t=0.7, top-k 6) keep the target's distribution, side by side in
    the same batches and batched drafting calls."""
    from test_sampling import NEW_TOKENS, PROMPT as SAMPLING_PROMPT, SAMPLES, drafters, min_p_value, plain_samples

    target = tiny_target("llama", vocab_size=10, hidden_size=32, num_hidden_layers=4, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)
    drafter = drafters(target)[name]
    settings = {"temperature": 0.7, "top_k": 6}
    reference = plain_samples(target, seed=1, **settings)
    greedy_prompts = [[3, 7, 5, 4], [2, 2, 9], [8, 1, 6, 6, 3]]
    torch.manual_seed(2)
    engine = SpeculativeEngine(target, drafter, max_batch_size=16)
    sampled, greedy = [], {}
    for i in range(SAMPLES):
        sampled.append(engine.submit(SAMPLING_PROMPT[0].tolist(), max_new_tokens=NEW_TOKENS, do_sample=True,
                                     eos_token_id=[], **settings))
        if i % 100 == 0:
            prompt = greedy_prompts[(i // 100) % 3]
            greedy[engine.submit(prompt, max_new_tokens=NEW_TOKENS + 6, eos_token_id=[])] = prompt
    outputs: dict[int, list[int]] = {}
    while engine.has_work:
        for event in engine.step():
            outputs.setdefault(event.request, []).extend(event.tokens)
    for request, prompt in greedy.items():
        assert prompt + outputs[request] == plain(target, prompt, max_new_tokens=NEW_TOKENS + 6, eos_token_id=None)
    assert sum(sum(entry["accepted"]) for entry in engine.stats) > SAMPLES // 4
    assert min_p_value(reference, torch.tensor([outputs[request] for request in sampled])) > 1e-3


def cutting_policy(explore_every: int = 5, slot_cost: float = 0.2, forward_seconds: float = 1.0, **gate):
    """A batch D-cut under which windows really vary: each extra slot costs ``slot_cost`` forwards.

    The draft gate compares real drafting seconds with these modelled forwards: a long modelled
    forward, taken as this machine's (no pace), keeps a loaded machine's slow drafting from
    deciding a test about cutting.
    """
    from angelspec_hf.generation import BatchDCutPolicy, CostModel

    one, wide = forward_seconds, forward_seconds * (1.0 + 7 * slot_cost)
    seconds = [[[one, one], [wide, wide]], [[1.5 * one, 1.5 * one], [1.5 * wide, 1.5 * wide]]]
    model = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 512], batch_sizes=[1, 16], seconds=seconds)
    return BatchDCutPolicy(model, explore_every=explore_every, track_pace=False, **gate)


@pytest.mark.parametrize("name", ["dfly", "mtp"])
def test_batch_dcut_cuts_and_every_row_equals_its_plain_generate(setup, name):
    target, drafters, prompts = setup
    policy = cutting_policy()
    engine = SpeculativeEngine(target, drafters[name], max_batch_size=4, policy=policy)
    outputs = engine.generate(prompts, max_new_tokens=25, eos_token_id=[])
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=25, eos_token_id=None)
    longest = drafters[name].max_draft_tokens + 1
    assert any(1 < w < longest for w in policy.windows) and longest in policy.windows, policy.windows


@pytest.mark.parametrize("name", ["dfly", "mtp"])
def test_bfloat16_drafters_beside_a_float32_target_keep_every_row_plain(setup, name):
    """The benchmark's engine drafts in bfloat16 beside its float32 target on CPUs with bfloat16
    units: the batched drafting paths take the target's float32 states, every row still equals its
    plain generate, and the bfloat16 drafts are still accepted."""
    target, drafters, prompts = setup
    drafter = copy.deepcopy(drafters[name]).to(torch.bfloat16).eval()
    engine = SpeculativeEngine(target, drafter, max_batch_size=4, policy=cutting_policy())
    outputs = engine.generate(prompts, max_new_tokens=25, eos_token_id=[])
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=25, eos_token_id=None)
    accepted = [a for entry in engine.stats for a in entry["accepted"]]
    assert max(accepted) >= 2, "bfloat16 drafts must really be accepted"


def test_engine_tells_the_batch_policy_whether_requests_wait_and_what_rows_have_left(setup):
    target, drafters, prompts = setup
    policy = cutting_policy(explore_every=2)
    seen, left, named = [], [], []
    window = policy.window

    def recording_window(confidences, batch, context, queued=True, remaining=None, arms=None):
        seen.append(queued)
        left.append((len(confidences), batch, remaining))
        named.append((len(confidences), arms))
        return window(confidences, batch, context, queued=queued, remaining=remaining, arms=arms)

    policy.window = recording_window
    engine = SpeculativeEngine(target, drafters["dfly"], max_batch_size=3, policy=policy)
    outputs = engine.generate(prompts, max_new_tokens=12)
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=12, eos_token_id=None)
    # 8 prompts, 3 slots: the first steps have requests waiting, the last ones none.
    assert seen[0] is True and seen[-1] is False, seen
    # One count per active row, each what that row still has to make; the first step follows the
    # prefill's token, so every row has 11 of its 12 left.
    assert left[0] == (3, 3, [11, 11, 11]), left[0]
    for drafting, batch, remaining in left:
        assert len(remaining) == batch and drafting <= batch and all(1 <= r <= 11 for r in remaining)
    assert any(len(set(remaining)) > 1 for _, _, remaining in left)
    # Every drafting row is named by its drafter (one drafter: the engine calls it "drafter").
    assert all(arms == ["drafter"] * drafting for drafting, arms in named), named
    assert set(policy.calibrators) == {"drafter"}


def test_engine_tells_the_batch_policy_what_a_drafter_has_yet_to_read(setup):
    """``catch_up``: decoded positions the drafter has not ingested for the rows drafting with it
    (their prompts not counted). Held back for three steps, it has every token decoded since to read."""
    target, drafters, prompts = setup
    policy = cutting_policy()
    asked = []
    should_draft = policy.should_draft

    def recording_should_draft(batch=None, context=None, queued=True, arm=None, catch_up=0):
        asked.append((batch, catch_up))
        return len(asked) > 3 and should_draft(batch, context, queued, arm=arm, catch_up=catch_up)

    policy.should_draft = recording_should_draft
    engine = SpeculativeEngine(target, drafters["dfly"], max_batch_size=3, policy=policy)
    outputs = engine.generate(prompts[:3], max_new_tokens=12)
    for prompt, output in zip(prompts[:3], outputs):
        assert output == plain(target, prompt, max_new_tokens=12, eos_token_id=None)
    # Each plain step commits one position a row (the prefill's token is the pending one at first).
    assert asked[:4] == [(3, 0), (3, 3), (3, 6), (3, 9)], asked
    # Once it drafts, it reads only what the previous step committed: one position a row and the accepted drafts.
    assert policy.windows and all(catch_up <= batch * (1 + drafters["dfly"].max_draft_tokens) for batch, catch_up in asked[4:])
    assert any(catch_up > batch for batch, catch_up in asked[4:]), "accepted drafts are read too"


def test_a_routed_batch_counts_what_its_probes_drafters_have_yet_to_read(setup):
    """Probing rows draft with every drafter once their verified one drafts, so its ``catch_up``
    counts the decoded positions the probes' drafters missed too."""
    target, drafters, prompts = setup
    policy = cutting_policy()
    asked = []
    should_draft = policy.should_draft

    def recording_should_draft(batch=None, context=None, queued=True, arm=None, catch_up=0):
        asked.append((arm, batch, catch_up))
        return len(asked) > 3 and should_draft(batch, context, queued, arm=arm, catch_up=catch_up)

    policy.should_draft = recording_should_draft
    engine = SpeculativeEngine(target, {"a": drafters["dfly"], "b": drafters["mtp"]}, max_batch_size=3, policy=policy)
    outputs = engine.generate(prompts[:3], max_new_tokens=12)
    for prompt, output in zip(prompts[:3], outputs):
        assert output == plain(target, prompt, max_new_tokens=12, eos_token_id=None)
    # Three probing rows verified with the first drafter: two drafters' reading, one position a row a step.
    assert asked[:3] == [("a", 3, 0), ("a", 3, 6), ("a", 3, 12)], asked
    assert policy.windows, "then they draft"


def test_batch_dcut_stops_drafting_that_never_pays(setup, monkeypatch):
    from angelspec_hf.generation import BatchDCutPolicy, CostModel, dcut

    target, drafters, prompts = setup
    # Every slot costs a whole forward: drafts can only lose.
    seconds = [[[1.0, 1.0], [8.0, 8.0]]]

    def run():
        policy = BatchDCutPolicy(CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 512],
                                           batch_sizes=[1], seconds=seconds), explore_every=4)
        engine = SpeculativeEngine(target, drafters["dfly"], max_batch_size=4, policy=policy)
        outputs = engine.generate(prompts, max_new_tokens=25)
        for prompt, output in zip(prompts, outputs):
            assert output == plain(target, prompt, max_new_tokens=25, eos_token_id=None)
        return policy, sum(entry["rounds"] for entry in engine.stats) / 4  # engine steps, at least

    # Not even a good drafter would pay here, so the drafter never takes its first step.
    policy, _ = run()
    assert policy.windows == [] and policy.gate_for("drafter").efficiency is None
    # Made to take it, the gate measures the loss and closes.
    monkeypatch.setattr(dcut, "FIRST_STEP_MIN_EFFICIENCY", 0.0)
    policy, steps = run()
    assert policy.gate_for("drafter").efficiency < 1.0 and len(policy.windows) < steps / 2, (policy.windows, steps)
    assert all(w == 1 for i, w in enumerate(policy.windows, 1) if i % 4), "only exploration keeps drafts"


@pytest.mark.parametrize("name", ["dfly", "mtp", "dfly+batch-dcut"])
@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_k": 6}], ids=["t1", "t0.7-top6"])
def test_engine_sampling_matches_plain_sampling(name, settings):
    """Chi-square homogeneity per position, p > 1e-3 with fixed seeds, as in test_sampling."""
    from test_sampling import NEW_TOKENS, PROMPT as SAMPLING_PROMPT, SAMPLES, drafters, min_p_value, plain_samples

    target = tiny_target("llama", vocab_size=10, hidden_size=32, num_hidden_layers=4, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)
    drafter = drafters(target)[name.split("+")[0]]
    reference = plain_samples(target, seed=1, **settings)
    torch.manual_seed(2)
    # Cheap slots: the random drafter's drafts must keep being verified, and cut.
    policy = cutting_policy(explore_every=3, slot_cost=0.01, forward_seconds=10.0) if name.endswith("batch-dcut") else None
    engine = SpeculativeEngine(target, drafter, max_batch_size=16, policy=policy)
    outputs = engine.generate([SAMPLING_PROMPT[0].tolist()] * SAMPLES, max_new_tokens=NEW_TOKENS, do_sample=True,
                              eos_token_id=[], **settings)
    samples = torch.tensor([out[SAMPLING_PROMPT.shape[1]:] for out in outputs])
    accepted = sum(sum(entry["accepted"]) for entry in engine.stats)
    assert accepted > SAMPLES // 4
    if policy is not None:
        assert any(1 < w < drafter.max_draft_tokens + 1 for w in policy.windows)
    assert min_p_value(reference, samples) > 1e-3


def test_engine_rows_follow_a_draft_policy(setup):
    from angelspec_hf.generation import CostModel, DCutPolicy

    target, drafters, prompts = setup
    drafter = drafters["dfly"]
    expensive = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 512], seconds=[[1.0, 1.0], [4.5, 4.5]])
    drafter.draft_policy = DCutPolicy(expensive, explore_every=4)
    try:
        engine = SpeculativeEngine(target, drafter, max_batch_size=4)
        outputs = engine.generate(prompts, max_new_tokens=20)
    finally:
        del drafter.draft_policy
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=20, eos_token_id=None)


def test_declared_domains_pick_their_drafter(setup):
    target, drafters, prompts = setup
    engine = SpeculativeEngine(target, {"code": drafters["dfly"], "chat": drafters["mtp"]}, max_batch_size=4)
    domains = ["code", "chat"] * 4
    outputs = engine.generate(prompts, max_new_tokens=20, domains=domains)
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=20, eos_token_id=None)
    assert {entry["index"]: entry["drafter"] for entry in engine.stats} == dict(enumerate(domains))


def test_each_declared_drafter_is_gated_on_its_own(setup):
    """With D-cut, the rows of a drafter whose drafts never pay stop drafting while the rows of the
    drafter beside them that pays keep drafting; every row still equals its plain generate."""
    from angelspec_hf.generation import BatchDCutPolicy, CostModel

    target, drafters, prompts = setup
    torch.manual_seed(9)
    useless = DFlyDrafter.from_target(target, block_size=5).eval()
    # Every verified slot costs a tenth of a forward, so drafts that are never accepted lose.
    tokens = [1, 2, 4, 8]
    cost = CostModel(target="t", hardware="t", tokens=tokens, contexts=[0, 512],
                     seconds=[[1.0 + 0.1 * (t - 1)] * 2 for t in tokens])
    policy = BatchDCutPolicy(cost, explore_every=4, probe_budget=None, track_pace=False)
    asked: dict[str, list[bool]] = {"fitted": [], "useless": []}
    should_draft = policy.should_draft

    def counted(batch, context, queued, arm):
        asked[arm].append(should_draft(batch, context, queued, arm=arm))
        return asked[arm][-1]

    policy.should_draft = counted
    engine = SpeculativeEngine(target, {"fitted": drafters["dfly"], "useless": useless}, max_batch_size=4,
                               policy=policy)
    # Requests wait for a slot (8 for 4), so D-cut maximises the tokens summed over rows.
    domains = ["fitted", "useless"] * 4
    outputs = engine.generate(prompts, max_new_tokens=30, domains=domains)
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=30, eos_token_id=None)
    # Once nothing waits, the run lasts as long as its slowest row, a useless drafter's one: the
    # fitted drafter's rows stop drafting too, since their drafts no longer shorten it.
    assert sum(asked["useless"]) < len(asked["useless"]) / 4, asked["useless"]
    assert sum(asked["fitted"]) > 0.7 * len(asked["fitted"]), asked["fitted"]


class _ClosedThenOpen:
    """A batch policy that keeps drafting off for the first ``closed`` steps, then never cuts."""

    def __init__(self, closed: int):
        self.closed = closed

    def should_draft(self, batch, context, queued, arm) -> bool:
        self.closed -= 1
        return self.closed < 0

    def window(self, confidences, batch, context, queued, remaining, arms) -> int:
        return 1 + max(map(len, confidences), default=0)

    def observe(self, outcomes, batch, width, context, draft_seconds, queued, arms) -> None:
        pass


def test_reading_the_prompt_is_catch_up_not_a_drafting_round(setup):
    """The share of a drafter's read that its round is charged for: none of a new request's prompt
    (read once per request; charged to the first round, it closed drafters that paid), all of one
    step's states, and the latest step's part of a backlog."""
    target, drafters, prompts = setup
    engine = SpeculativeEngine(target, drafters["mtp"], max_batch_size=2)
    captured = []
    take = engine._take_pending

    def recorded(row, arm):
        committed, result = row.generators[arm].committed, take(row, arm)
        captured.append((committed, result[1]))
        return result

    engine._take_pending = recorded
    engine.generate([prompts[7]], max_new_tokens=12)
    (first_committed, first_share), *later = captured
    assert first_committed == 0 and first_share == 0.0
    assert later and all(committed > 0 and share == 1.0 for committed, share in later), later
    row = SimpleNamespace(pending={"a": [(torch.zeros(1, 6, 4),), (torch.zeros(1, 2, 4),)]},
                          generators={"a": SimpleNamespace(committed=9)})
    states, share = SpeculativeEngine._take_pending(row, "a")
    assert states.hidden_states[0].shape[1] == 8 and share == 0.25


def _fitted_against_useless(setup, max_batch_size: int, policy=None) -> SpeculativeEngine:
    """An engine routing between a fitted drafter, a useless one and no drafter."""
    target, drafters, _ = setup
    torch.manual_seed(9)
    useless = DFlyDrafter.from_target(target, block_size=5).eval()
    return SpeculativeEngine(target, {"fitted": drafters["dfly"], "useless": useless},
                             max_batch_size=max_batch_size, probe_rounds=2, policy=policy)


def _serve_five_checked(setup, engine: SpeculativeEngine, forward_seconds: float = 0.0) -> None:
    """Five requests through ``engine``, each output checked against plain greedy decoding.

    ``forward_seconds`` makes every target forward cost that much (what a real one costs relative
    to tiny drafters; with its natural microseconds "no drafter" would rightly win the routing)."""
    import time

    target, _, prompts = setup
    handle = target.register_forward_pre_hook(lambda module, args: time.sleep(forward_seconds)) if forward_seconds else None
    try:
        outputs = engine.generate(prompts[:5], max_new_tokens=30)
    finally:
        if handle is not None:
            handle.remove()
    for prompt, output in zip(prompts, outputs):
        assert output == plain(target, prompt, max_new_tokens=30, eos_token_id=None)


def test_unknown_domains_are_routed_to_the_drafter_that_pays(setup):
    """Requests settle on the fitted drafter. A request whose two probes of the fitted drafter
    both missed may rightly settle on no drafter."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    _serve_five_checked(setup, engine, forward_seconds=0.1)
    chosen = [entry["drafter"] for entry in engine.stats]
    assert chosen.count("fitted") >= 3 and "useless" not in chosen, chosen


def test_rounds_without_drafting_do_not_count_as_probes(setup):
    """While the policy keeps drafting off, every arm would look like "no drafter": the probes wait."""
    engine = _fitted_against_useless(setup, max_batch_size=5, policy=_ClosedThenOpen(closed=8))
    _serve_five_checked(setup, engine, forward_seconds=0.1)
    chosen = [entry["drafter"] for entry in engine.stats]
    assert chosen.count("fitted") >= 3 and "useless" not in chosen, chosen
    # The fitted drafter's probes ran with drafting on: they gained more than one token a round.
    assert sum(entry["probes"]["fitted"][0] for entry in engine.stats) > 2 * len(engine.stats)


def test_a_candidate_drafter_ingests_only_when_it_drafts(setup):
    """A drafter that loses the probes reads the request's states only to draft its probes: exactly
    one ingest per probe (before, every candidate ingested every round until the request settled,
    which made routing cost more than the drafters it chose between); none at all once the pooled
    evidence stops later requests from probing it."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    ingests: dict[tuple[int, str], int] = {}
    new_generator = engine._new_generator

    def counted(row, drafter):
        generator = new_generator(row, drafter)
        arm = next(name for name, model in engine.drafters.items() if model is drafter)
        # Every ingest, alone or batched with other rows (`observe_many`), reads its row's new states here.
        new_features = generator._new_features

        def counted_features(*args, **kwargs):
            ingests[row.index, arm] = ingests.get((row.index, arm), 0) + 1
            return new_features(*args, **kwargs)

        generator._new_features = counted_features
        return generator

    engine._new_generator = counted
    _serve_five_checked(setup, engine)
    for entry in engine.stats:
        for arm in ("fitted", "useless"):
            if arm != entry["drafter"]:
                probe_rounds = entry["probes"].get(arm, (0, 0.0, 0))[2]
                assert probe_rounds in (0, 2), entry
                assert ingests.get((entry["index"], arm), 0) == probe_rounds, (entry, ingests)


def test_a_routed_backlog_holds_only_its_own_rows_states(setup):
    """Each queued state owns its storage: a view into the verify forward's batch would keep the
    states of every row of that forward alive for as long as the backlog waits."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    queue = engine._queue_outputs
    queued = []

    def checked(row, outputs):
        queued.extend(h for h in outputs if h is not None)
        return queue(row, outputs)

    engine._queue_outputs = checked
    _serve_five_checked(setup, engine)
    assert queued
    for states in queued:
        assert states.untyped_storage().nbytes() == states.numel() * states.element_size(), states.shape


def _routed_row(engine: SpeculativeEngine, scores: dict) -> "object":
    """A routed request whose probes are all scored, with these (tokens, seconds, rounds)."""
    from angelspec_hf.generation.engine import _Row

    row = _Row(0, [1, 2, 3], 3, 10, arm=next(iter(scores)))
    row.generators = {arm: object() for arm in engine.drafters}
    row.arm_scores = {arm: list(score) for arm, score in scores.items()}
    return row


def test_a_request_weighs_its_probes_against_the_pooled_evidence(setup):
    """Two missed drafts make a good drafter look worse than no drafter; evidence pooled over
    earlier requests (4 tokens a round against 1) keeps the request on the drafter, while the
    request's own probes alone would have settled on "no drafter"."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    probes = {"fitted": (2, 0.08, 2), "useless": (2, 0.08, 2), "none": (2, 0.06, 2)}
    alone = _routed_row(engine, probes)
    engine._settle(alone)
    assert alone.arm == "none" and alone.generators == {} and alone.probing == []
    engine.arm_evidence.update({"fitted": [400, 4.0, 100], "useless": [20, 0.8, 10], "none": [10, 0.3, 10]})
    pooled = _routed_row(engine, probes)
    engine._settle(pooled)
    assert pooled.arm == "fitted" and set(pooled.generators) == {"fitted"}


def test_probes_are_scored_against_the_committed_text():
    """A probe gains its drafts up to the first one the request did not commit, plus the target's
    own token; it waits while the committed text is too short to tell, unless the request ended."""
    from angelspec_hf.generation.engine import _Probe, _Row

    engine = SpeculativeEngine.__new__(SpeculativeEngine)
    engine.arm_evidence, engine.probe_rounds, engine.drafters = {}, 1, {}
    engine.arm_record, engine.route_margin, engine.policy = {}, 0.25, None
    engine._rows, engine.call_seconds, engine.step_seconds = [], {}, None
    row = _Row(0, [1, 2, 3, 7, 8, 9], 3, 10, probing=["a", "b", "c", "none"])
    row.probes = [
        _Probe("a", 3, [7, 8, 5], 0.01, 0.1),  # misses at its third token: 2 drafts + 1
        _Probe("b", 3, [7, 8, 9, 4], 0.02, 0.1),  # all committed so far match: undecided
        _Probe("c", 3, [7, 8], 0.03, 0.1),  # every draft committed: 2 + 1
        _Probe("none", 3, [], 0.0, 0.1),
    ]
    engine._score_probes(row, ended=False)
    assert row.arm_scores == {"a": [3, pytest.approx(0.11), 1], "c": [3, pytest.approx(0.13), 1], "none": [1, 0.1, 1]}
    assert [probe.arm for probe in row.probes] == ["b"] and row.probing  # not settled: "b" undecided
    row.tokens.append(4)
    engine._score_probes(row, ended=False)
    assert row.arm_scores["b"] == [5, pytest.approx(0.12), 1] and row.probes == []
    assert row.probing == [] and row.arm == "b"  # 5 tokens in 0.12 s: the best rate
    assert engine.arm_evidence == row.arm_scores
    # Competitive: within 25% of the best rate (41.7 tokens/s): "b" alone; "a" makes 27.3.
    assert engine.arm_record == {"a": [0, 1], "b": [1, 1], "c": [0, 1], "none": [0, 1]}
    ended = _Row(0, [1, 2, 3, 7], 3, 1, probing=["b"])
    ended.probes = [_Probe("b", 3, [7, 8], 0.02, 0.1)]
    engine._score_probes(ended, ended=True)
    assert ended.arm_scores == {"b": [2, pytest.approx(0.12), 1]} and ended.probes == []


def test_arms_competitive_for_no_request_are_not_probed(setup):
    """An arm is dropped from later requests' probes once enough requests probed it and it came
    near the best in none; one competitive in a single request stays (in a mixed workload the
    drafter that loses on chat can win on code). The others are ordered by pooled rate."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    assert engine._arms_to_probe() == ["fitted", "useless", "none"]
    engine.arm_record.update({"fitted": [3, 3], "useless": [0, 3], "none": [1, 3]})
    assert engine._arms_to_probe() == ["fitted", "useless", "none"]  # 3 requests: too few to judge
    engine.arm_record.update({"fitted": [4, 4], "useless": [0, 4], "none": [1, 4]})
    assert engine._arms_to_probe() == ["fitted", "none"]
    # A pooled rate far behind does not drop an arm that was competitive somewhere.
    engine.arm_evidence.update({"fitted": [400, 4.0, 100], "none": [10, 1.0, 30]})
    engine.arm_record["useless"] = [1, 9]
    engine.arm_evidence["useless"] = [8, 0.8, 8]
    assert engine._arms_to_probe() == ["fitted", "useless", "none"]


def test_timings_wait_for_the_device(setup, monkeypatch):
    """A GPU runs kernels asynchronously, so every timing the policy and the router read (verify
    forward, ingesting, proposing) ends only once the device has run the work; a CPU waits for
    nothing. The engine waits on its target's device at each of those boundaries."""
    from angelspec_hf import modeling_angelspec_common as common
    from angelspec_hf.generation import engine as engine_module

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    common.wait_for_device(torch.device("cpu"))
    common.wait_for_device(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]
    target, drafters, prompts = setup
    waits, proposing = [], []
    monkeypatch.setattr(engine_module, "wait_for_device", lambda device: waits.append(device))
    monkeypatch.setattr(common, "wait_for_device", lambda device: proposing.append(device))
    engine = SpeculativeEngine(target, drafters["dfly"], max_batch_size=2)
    forwards = []
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        engine.generate(prompts[:2], max_new_tokens=8)
    finally:
        hook.remove()
    # Per step: after the verify forward, and after a drafting call's ingesting when it drafts; the
    # proposing waits inside the drafter's `propose_many`, whose own timing the policy reads too.
    assert set(waits) == {target.device} and len(waits) >= len(forwards) - 1
    assert proposing and set(proposing) == {target.device}


def test_routing_reprices_a_closed_drafter_at_the_steps_conditions(setup):
    """A drafter closed under load and used by no row is never asked `should_draft`, so routing asks
    the policy with the step's batch, context and queue state (`BatchDCutPolicy.is_open`), which
    reopens it where the batch has shrunk enough; a policy whose `is_open` takes only the arm is
    asked as before."""
    from angelspec_hf.generation import BatchDCutPolicy, CostModel

    class OnlyArm:
        def __init__(self):
            self.asked = []

        def is_open(self, arm):
            self.asked.append(arm)
            return False

    cost = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 100], batch_sizes=[1, 16],
                     seconds=[[[1.0, 1.0], [1.2, 1.2]], [[2.0, 2.0], [16.0, 16.0]]])
    policy = BatchDCutPolicy(cost, probe_budget=None, track_pace=False)
    policy.observe([([0.9] * 7, 3)] * 16, batch=16, width=8, context=10, draft_seconds=1.6, queued=False,
                   arms=["fitted"] * 16)
    engine = _fitted_against_useless(setup, max_batch_size=4, policy=policy)
    assert not engine._arm_open("fitted")  # outside a step: the gate as it stands
    engine._conditions = {"batch": 16, "context": 10, "queued": False}
    assert not engine._arm_open("fitted")
    engine._conditions = {"batch": 1, "context": 10, "queued": False}
    assert engine._arm_open("fitted") and engine._arm_open("useless")
    plain = _fitted_against_useless(setup, max_batch_size=4, policy=OnlyArm())
    plain._conditions = {"batch": 1, "context": 10, "queued": False}
    assert not plain._arm_open("fitted") and plain.policy.asked == ["fitted"]


def test_a_drafting_call_is_priced_without_its_catch_up():
    """The split threshold prices a drafter's call on every later step, so a call that also read
    joining prompts counts only the latest states' share of its ingesting, plus its proposing."""
    from angelspec_hf.generation.engine import steady_call_seconds

    # Four rows: one read only its prompt (share 0), three only the latest forward's states (share 1).
    assert steady_call_seconds(0.008, 0.010, [0.0, 1.0, 1.0, 1.0]) == pytest.approx(0.010 + 0.006)
    assert steady_call_seconds(0.004, 0.010, [1.0, 1.0]) == pytest.approx(0.014)  # caught up: all of it
    assert steady_call_seconds(0.020, 0.005, [0.25]) == pytest.approx(0.010)  # 3/4 of its states were missed ones
    assert steady_call_seconds(0.003, 0.005, []) == pytest.approx(0.008)


def test_a_request_joins_the_drafter_its_batch_drafts_with_unless_a_split_pays(setup):
    """A drafter no other row of the batch drafts with adds its whole call to every step: a request
    settles on it only if its rate beats the batch's drafter by ``1 + B * call / step`` (here 1 + 2
    * 0.01 / 0.1 = 1.2), or if the pooled evidence puts it more than 10% ahead (so that a batch on a
    worse drafter moves over). Alone in the batch, or when "no drafter" wins, the best rate settles."""
    from angelspec_hf.generation.engine import _Row

    engine = _fitted_against_useless(setup, max_batch_size=4)
    close = {"fitted": (8, 0.1, 2), "useless": (7, 0.1, 2), "none": (2, 0.1, 2)}  # 80 against 70 tokens/s: 1.14x
    engine._settle(row := _routed_row(engine, close))
    assert row.arm == "fitted"  # nobody else in the batch
    other = _Row(1, [1, 2, 3], 3, 10, arm="useless", generators={"useless": object()})
    engine.call_seconds, engine.step_seconds = {"fitted": 0.01, "useless": 0.01}, 0.1
    row = _routed_row(engine, close)
    engine._rows = [other, row]
    assert engine._split_threshold("fitted") == pytest.approx(1.2)
    engine._settle(row)
    assert row.arm == "useless"
    row = _routed_row(engine, {**close, "fitted": (9, 0.1, 2)})  # 90 against 70: 1.29x pays
    engine._rows = [other, row]
    engine._settle(row)
    assert row.arm == "fitted"
    row = _routed_row(engine, {**close, "none": (10, 0.1, 2)})  # no drafter adds no call
    engine._rows = [other, row]
    engine._settle(row)
    assert row.arm == "none"
    engine.arm_evidence.update({"fitted": [120, 1.0, 40], "useless": [100, 1.0, 40]})  # pooled: 1.2x ahead
    row = _routed_row(engine, close)
    engine._rows = [other, row]
    engine._settle(row)
    assert row.arm == "fitted"
    engine.arm_evidence["fitted"] = [105, 1.0, 40]  # 1.05x: not enough to split the batch for
    row = _routed_row(engine, close)
    engine._rows = [other, row]
    engine._settle(row)
    assert row.arm == "useless"
    other.tokens += [4] * 10  # finished rows do not draft
    row = _routed_row(engine, close)
    engine._rows = [other, row]
    engine._settle(row)
    assert row.arm == "fitted"


def test_drafting_calls_are_priced_by_a_line_through_their_sizes():
    """A drafting call's fixed part and per-row part, from calls of two or more sizes: the
    least-squares line, flat where larger calls timed faster, through the origin where the line
    would cut below it; nothing from one size."""
    from angelspec_hf.generation.engine import call_seconds_at

    assert call_seconds_at({}, 4) is None and call_seconds_at({2: 0.01}, 4) is None
    assert call_seconds_at({1: 0.008, 4: 0.0135}, 4) == pytest.approx(0.0135)
    assert call_seconds_at({1: 0.008, 4: 0.0135}, 2) == pytest.approx(0.008 + 0.0055 / 3)
    assert call_seconds_at({1: 0.008, 2: 0.010, 3: 0.012}, 16) == pytest.approx(0.006 + 0.002 * 16)
    assert call_seconds_at({1: 0.010, 4: 0.008}, 4) == pytest.approx(0.009)  # no negative slope
    assert call_seconds_at({1: 0.001, 2: 0.004}, 4) == pytest.approx(4 * 0.009 / 5)  # no negative intercept


def test_a_probe_is_priced_at_the_batchs_share_of_its_drafters_call(setup):
    """A probe asks how well a drafter would serve the request with the whole batch drafting with
    it: its drafting counts the batch's share of a call, not the call it was drafted in alone,
    once calls of two sizes have been timed; before, what it measured."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    assert engine._probe_draft_seconds("useless", 4, 0.008) == 0.008
    engine.call_sizes["useless"] = {1: 0.008, 4: 0.0135}
    assert engine._probe_draft_seconds("useless", 4, 0.008) == pytest.approx(0.0135 / 4)
    assert engine._probe_draft_seconds("useless", 2, 0.008) == pytest.approx((0.008 + 0.0055 / 3) / 2)
    # A routed pass records every call's size, and its probes stay exact.
    engine = _fitted_against_useless(setup, max_batch_size=4)
    _serve_five_checked(setup, engine)
    assert set(engine.call_sizes) <= {"fitted", "useless"} and engine.call_sizes
    assert all(size >= 1 and seconds > 0 for sizes in engine.call_sizes.values() for size, seconds in sizes.items())


def test_a_probing_request_is_verified_with_the_batchs_drafter_unless_another_is_well_ahead(setup):
    """The arm verified while a request probes is the best pooled one, unless the batch's rows draft
    with another drafter the pooled evidence does not put more than 10% behind it: verifying the
    newcomer with the other would split the batch's drafting into two calls."""
    from angelspec_hf.generation.engine import _Row

    engine = _fitted_against_useless(setup, max_batch_size=4)
    engine.call_seconds, engine.step_seconds = {"fitted": 0.01, "useless": 0.01}, 0.1
    engine.arm_evidence.update({"fitted": [105, 1.0, 40], "useless": [100, 1.0, 40]})
    probing = ["fitted", "useless", "none"]
    assert engine._live_arm(probing) == "fitted"  # an empty batch: the pooled best
    other = _Row(1, [1, 2, 3], 3, 10, arm="useless", generators={"useless": object()})
    engine._rows = [other]
    assert engine._live_arm(probing) == "useless"  # 5% ahead: not worth a second call
    engine.arm_evidence["fitted"] = [115, 1.0, 40]
    assert engine._live_arm(probing) == "fitted"  # 15% ahead by every request's probes
    engine.arm_evidence["fitted"] = [105, 1.0, 40]
    other.tokens += [4] * 10  # a finished row drafts with nothing
    assert engine._live_arm(probing) == "fitted"


def test_a_group_joins_the_drafter_the_batch_drafts_with_once_its_own_call_does_not_pay(setup):
    """Settled requests keep a drafter only they draft with while their mean rate ratio over the
    batch's other drafter beats ``1 + B * call / (step * rows)`` (4 rows, a 0.01 s call, a 0.1 s
    step: 1.4 for one row, 1.2 for two), else they move there together. Only to an open drafter the
    policy has measured and every one of them holds, and not while a probing request is verified
    with their drafter."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    closed, measured = set(), {"fitted", "useless"}
    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed, measured=lambda arm: arm in measured)
    engine.call_seconds, engine.step_seconds = {"fitted": 0.01, "useless": 0.01}, 0.1

    def batch(useless_rows: int, useless_tokens: int, fitted_tokens: int = 7):
        rows = [_routed_row(engine, {"fitted": (8, 0.1, 2), "useless": (7, 0.1, 2)}) for _ in range(4 - useless_rows)]
        for _ in range(useless_rows):
            rows.append(row := _routed_row(engine, {"fitted": (fitted_tokens, 0.1, 2), "useless": (useless_tokens, 0.1, 2)}))
            row.arm = "useless"
        engine._rows = rows
        return rows

    rows = batch(1, 9)  # 90 against 70 tokens/s: 1.29x, under 1.4
    engine._consolidate(rows)
    assert [row.arm for row in rows] == ["fitted"] * 4 and rows[-1].switches == 1
    rows = batch(1, 10)  # 1.43x: its own call pays
    engine._consolidate(rows)
    assert rows[-1].arm == "useless" and rows[-1].switches == 0
    rows = batch(2, 9)  # two rows at 1.29x share the call: over 1.2, and the other group gains only 1.14x
    rows[0].arm_scores["fitted"] = [9, 0.1, 2]  # so that neither group moves: 90 against 70
    rows[1].arm_scores["fitted"] = [9, 0.1, 2]
    engine._consolidate(rows)
    assert [row.arm for row in rows] == ["fitted", "fitted", "useless", "useless"]
    rows = batch(1, 9)
    rows[0].probing = ["useless", "fitted", "none"]  # a probing request verified with "useless": its call stays
    rows[0].arm = "useless"
    engine._consolidate(rows)
    assert rows[-1].arm == "useless"
    for blocked in ("closed", "unmeasured", "not held"):
        rows = batch(1, 9)
        if blocked == "closed":
            closed.add("fitted")
        elif blocked == "unmeasured":
            measured.discard("fitted")
        else:
            del rows[-1].generators["fitted"]
        engine._consolidate(rows)
        assert rows[-1].arm == "useless", blocked
        closed.clear()
        measured.update({"fitted", "useless"})


def test_a_request_does_not_settle_on_a_drafter_the_policy_keeps_closed(setup):
    """Rows on a closed drafter decode plainly: the request settles on the best open drafter
    (or "no drafter"), unless every drafter it probed is closed."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    closed: set = set()
    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed)
    probes = {"fitted": (8, 0.1, 2), "useless": (6, 0.1, 2), "none": (2, 0.08, 2)}
    assert engine._settling_arms(_routed_row(engine, probes)) == ["fitted", "none", "useless"]
    closed.add("fitted")
    row = _routed_row(engine, probes)
    engine._settle(row)
    assert row.arm == "useless" and set(row.generators) == {"useless", "fitted"}  # the other idle
    closed.add("useless")
    row = _routed_row(engine, probes)
    engine._settle(row)
    assert row.arm == "fitted"  # every drafter closed: none left out


def test_a_request_leaves_a_drafter_the_policy_closes_after_it_settled(setup):
    """Settled while both drafters were open, the request keeps the other one idle; whenever the
    policy closes its drafter and the other is open, it moves there (and back, if that one closes
    and its first reopens), keeping both."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    closed: set = set()
    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed)
    row = _routed_row(engine, {"fitted": (8, 0.1, 2), "useless": (6, 0.1, 2), "none": (2, 0.08, 2)})
    engine._settle(row)
    assert row.arm == "fitted" and set(row.generators) == {"fitted", "useless"}
    engine._leave_closed_drafter(row)
    assert row.arm == "fitted" and row.switches == 0  # its drafter is open: it stays
    closed.update({"fitted", "useless"})
    engine._leave_closed_drafter(row)
    assert row.arm == "fitted" and row.switches == 0  # nowhere open to go
    closed.discard("useless")
    engine._leave_closed_drafter(row)
    assert row.arm == "useless" and row.switches == 1 and set(row.generators) == {"useless", "fitted"}
    closed.add("useless")
    engine._leave_closed_drafter(row)
    assert row.arm == "useless" and row.switches == 1  # both closed: it stays
    closed.discard("fitted")
    engine._leave_closed_drafter(row)
    assert row.arm == "fitted" and row.switches == 2
    # Without a policy that gates drafters, a settled request keeps its drafter alone.
    engine.policy = None
    row = _routed_row(engine, {"fitted": (8, 0.1, 2), "useless": (6, 0.1, 2)})
    engine._settle(row)
    assert set(row.generators) == {"fitted"}


def test_a_settled_request_leaves_a_closed_drafter_only_for_a_measured_one(setup):
    """Settled on a drafter the policy closed, a request does not move to one that is open only
    because the policy has not measured it yet (it decodes plainly until one is measured open);
    a probing request does, since its probes wait for a drafting round."""
    from angelspec_hf.generation.engine import _Row

    engine = _fitted_against_useless(setup, max_batch_size=4)
    measured: set = set()
    engine.policy = SimpleNamespace(is_open=lambda arm: arm != "fitted", measured=lambda arm: arm in measured)
    row = _Row(0, [1, 2, 3], 3, 10, arm="fitted")
    row.generators = {arm: object() for arm in engine.drafters}
    engine._leave_closed_drafter(row)
    assert row.arm == "fitted" and row.switches == 0
    measured.add("useless")
    engine._leave_closed_drafter(row)
    assert row.arm == "useless" and row.switches == 1
    measured.clear()
    probing = _Row(0, [1, 2, 3], 3, 10, arm="fitted", probing=["fitted", "useless", "none"])
    probing.generators = {arm: object() for arm in engine.drafters}
    engine._leave_closed_drafter(probing)
    assert probing.arm == "useless" and probing.switches == 1


def test_a_probing_request_verifies_an_open_drafter(setup):
    """While a request probes, a closed verified drafter would hold it on plain rounds (its
    probes wait for a drafting round): the open probed drafter with the best pooled rate is
    verified instead; an open one never moves, nor one whose alternatives are closed or unprobed."""
    from angelspec_hf.generation.engine import _Row

    engine = _fitted_against_useless(setup, max_batch_size=4)
    closed: set = set()
    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed)
    row = _Row(0, [1, 2, 3], 3, 10, arm="useless", probing=["useless", "none"])
    row.generators = {arm: object() for arm in engine.drafters}
    engine._leave_closed_drafter(row)
    assert row.arm == "useless"  # open
    closed.add("useless")
    engine._leave_closed_drafter(row)
    assert row.arm == "useless" and row.switches == 0  # "fitted" is not among its probed arms
    row.probing = ["useless", "fitted", "none"]
    closed.add("fitted")
    engine._leave_closed_drafter(row)
    assert row.arm == "useless"  # every drafter closed
    closed.discard("fitted")
    engine._leave_closed_drafter(row)
    assert row.arm == "fitted" and row.switches == 1 and row.probing == ["useless", "fitted", "none"]


def test_a_probing_request_stops_probing_closed_drafters(setup):
    """A drafter the policy keeps closed while another probed drafter is open is no longer probed
    once the request has drafted its own probes of it (only those can settle it there); a request
    whose other arms have been probed enough then settles at once. With every drafter closed,
    nothing is dropped."""
    engine = _fitted_against_useless(setup, max_batch_size=4)
    closed: set = set()
    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed)
    row = _routed_row(engine, {"fitted": (8, 0.1, 2), "none": (2, 0.08, 2)})
    row.probing = ["fitted", "useless", "none"]
    engine._stop_probing_closed(row)
    assert row.probing == ["fitted", "useless", "none"]  # "useless" open, not yet probed: waits for it
    assert engine._shadow_arms(row) == ["useless"]
    closed.update({"fitted", "useless"})
    engine._stop_probing_closed(row)
    assert row.probing == ["fitted", "useless", "none"]  # every drafter closed
    closed.discard("fitted")
    engine._stop_probing_closed(row)
    assert row.probing == ["fitted", "useless", "none"]  # "useless" closed, but not yet probed by this request
    row.arm_scores["useless"] = [2, 0.1, 2]
    engine._stop_probing_closed(row)
    assert row.probing == [] and row.arm == "fitted" and engine._shadow_arms(row) == []  # settled


def test_a_closed_drafter_a_request_finds_far_ahead_is_measured_afresh(setup):
    """A drafter's gate is measured on other requests' rows: a request whose own probes put a
    closed drafter at `REOPEN_FACTOR` times the best open one settles on it and the policy forgets
    what the gate measured (`reopen`); below that, or with a policy that cannot reopen, it does not."""
    from angelspec_hf.generation.engine import REOPEN_FACTOR

    engine = _fitted_against_useless(setup, max_batch_size=4)
    closed, reopened = {"fitted"}, []

    def reopen(arm):
        reopened.append(arm)
        closed.discard(arm)

    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed, reopen=reopen)
    useless = (4, 0.1, 2)  # 40 tokens/s, open
    behind = _routed_row(engine, {"fitted": (int(4 * REOPEN_FACTOR) - 1, 0.1, 2), "useless": useless, "none": (2, 0.1, 2)})
    engine._settle(behind)
    assert behind.arm == "useless" and reopened == []
    ahead = _routed_row(engine, {"fitted": (int(4 * REOPEN_FACTOR), 0.1, 2), "useless": useless, "none": (2, 0.1, 2)})
    assert engine._settling_arms(ahead) == ["fitted", "none", "useless"]
    engine._settle(ahead)
    assert ahead.arm == "fitted" and reopened == ["fitted"]
    closed.add("fitted")
    engine.policy = SimpleNamespace(is_open=lambda arm: arm not in closed)  # no `reopen`
    row = _routed_row(engine, {"fitted": (40, 0.1, 2), "useless": useless, "none": (2, 0.1, 2)})
    engine._settle(row)
    assert row.arm == "useless"


def test_batch_dcut_reopen_forgets_a_closed_gate():
    policy = cutting_policy()
    gate = policy.gate_for("a")
    gate.record_rate(1.0, 2.0, 1.0, 1.0)  # half a plain step's rate: closed
    assert not policy.is_open("a")
    policy.reopen("a")
    assert policy.is_open("a") and policy.gate_for("a").efficiency is None


@pytest.mark.parametrize("closes_after", [6, 0])
def test_requests_that_leave_a_closed_drafter_stay_exact(setup, closes_after):
    """Served end to end by a policy that closes the fitted drafter once requests have settled on
    it (or from the start, while they probe with it verified): they move to the other drafter,
    which catches up on the states it missed, and every output stays token-identical to plain
    decoding."""
    policy = cutting_policy(explore_every=1000, slot_cost=0.0)
    policy.is_open = lambda arm=None: arm != "fitted" or policy.decisions < closes_after
    engine = _fitted_against_useless(setup, max_batch_size=2, policy=policy)
    _serve_five_checked(setup, engine, forward_seconds=0.05)
    assert any(entry["switches"] for entry in engine.stats), engine.stats


def test_later_requests_skip_the_arm_earlier_ones_found_useless(setup):
    """Served two at a time, the requests that join later know from the pooled evidence that the
    useless drafter does not pay and go straight to probing the others; outputs stay exact."""
    engine = _fitted_against_useless(setup, max_batch_size=2)
    _serve_five_checked(setup, engine, forward_seconds=0.05)
    first, last = (min(engine.stats, key=lambda e: e["index"]), max(engine.stats, key=lambda e: e["index"]))
    assert "useless" in first["probes"] and "useless" not in last["probes"], engine.stats
    # What prices a drafter drafting for one row alone (`_split_threshold`) was measured on the way.
    assert set(engine.call_seconds) == {"fitted", "useless"} and engine.step_seconds > 0
    tokens, seconds, rounds = engine.arm_evidence["fitted"]
    assert rounds > 4 * engine.probe_rounds and tokens / rounds > 1.5


def test_routing_arguments_are_checked(setup):
    target, drafters, _ = setup
    with pytest.raises(ValueError, match="probe_rounds"):
        SpeculativeEngine(target, {"a": drafters["dfly"]}, probe_rounds=0)
    with pytest.raises(ValueError, match="route_margin"):
        SpeculativeEngine(target, {"a": drafters["dfly"]}, route_margin=1.0)


def test_probing_verifies_only_the_pooled_best_arm(setup):
    """While a request probes, the other arms draft side by side but only the live arm, the best by
    the pooled evidence, is verified: no round goes to an arm the evidence puts behind."""
    engine = _fitted_against_useless(setup, max_batch_size=2)
    engine.arm_evidence.update({"fitted": [400, 4.0, 100], "useless": [140, 1.4, 100], "none": [30, 0.4, 30]})
    engine.arm_record.update({"useless": [1, 1], "none": [1, 1]})  # competitive once: never dropped from the probes
    assert engine._arms_to_probe() == ["fitted", "useless", "none"]
    assert engine._live_arm(engine._arms_to_probe()) == "fitted"
    verified: list[tuple[int, str]] = []
    step = engine._step

    def recorded(rows, *args, **kwargs):
        verified.extend((row.index, row.arm) for row in rows if row.probing)
        return step(rows, *args, **kwargs)

    engine._step = recorded
    _serve_five_checked(setup, engine)
    assert verified and {arm for _, arm in verified} == {"fitted"}, verified
    for entry in engine.stats:
        assert {"fitted", "useless", "none"} <= set(entry["probes"]), entry


def test_routed_rows_are_calibrated_per_drafter(setup):
    """In a routed batch each drafter's confidences calibrate on their own: the useless drafter's
    misses never lower what the fitted drafter's confidences are worth. (A low gate margin keeps
    the useless drafter drafting, so that its rows are verified and calibrate at all.)"""
    policy = cutting_policy(explore_every=2, close_below=0.05)
    target, drafters, _ = setup
    torch.manual_seed(9)
    useless = DFlyDrafter.from_target(target, block_size=5).eval()
    # The useless drafter first: before there is evidence the first drafter is the one verified.
    engine = SpeculativeEngine(target, {"useless": useless, "fitted": drafters["dfly"]}, max_batch_size=4,
                               probe_rounds=2, policy=policy)
    _serve_five_checked(setup, engine, forward_seconds=0.05)
    assert set(policy.calibrators) == {"fitted", "useless"}, policy.calibrators
    fitted, useless = (sum(policy.calibrators[arm].seen) for arm in ("fitted", "useless"))
    assert fitted > 0 and useless > 0


def test_probes_pause_while_the_verified_drafter_is_measured_closed(setup):
    """While the policy says a probing request's verified drafter does not pay, and no other
    drafter is open to move to, that drafter drafts alone (probes beside it would only multiply
    drafting that does not pay); while it is open, measured or not, the other drafter probes
    beside it. Outputs stay exact either way."""
    closed = {"fitted", "useless"}
    policy = cutting_policy(explore_every=1000, slot_cost=0.0)
    policy.is_open = lambda arm=None: arm not in closed
    engine = _fitted_against_useless(setup, max_batch_size=4, policy=policy)
    drafted: list[str] = []
    draft = engine._draft

    def recorded(rows, active, batch):
        drafted.extend(arm for row, a in zip(rows, active) if a for arm in engine._shadow_arms(row))
        return draft(rows, active, batch)

    engine._draft = recorded
    _serve_five_checked(setup, engine, forward_seconds=0.01)
    assert drafted == [] and all(entry["drafter"] == "fitted" for entry in engine.stats), engine.stats
    closed.clear()
    _serve_five_checked(setup, engine, forward_seconds=0.01)
    assert "useless" in drafted, drafted
