"""MTP training with training-time test: train/inference agreement, packing, the trainer."""

import json

import pytest
import torch
from transformers import AutoModel, GenerationConfig

from angelspec_hf import MTPDrafter
from angelspec_hf.modeling_angelspec_mtp import MTPCandidateGenerator
from angelspec_hf.errors import DrafterConfigError
from angelspec_hf.training.mtp import chain_loss, grow_mtp_layers, rewire_mtp_target_layers
from angelspec_hf.training.recipes import Recipe, train_drafter
from conftest import PROMPT_LENGTH


def run_chain(target, drafter, sequences, **kwargs):
    out = target.base_model(sequences, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    batch, length = sequences.shape
    return chain_loss(drafter, features, sequences, out.last_hidden_state, target.get_input_embeddings(),
                      target.get_output_embeddings(), torch.full((batch,), PROMPT_LENGTH), torch.full((batch,), length),
                      **kwargs)


def sharpen_attention(drafter) -> None:
    """Sharp, strong attention in every layer, so that a draft step placed one position off (as
    inference once did) or a layer reading another layer's keys changes which tokens the chain
    drafts; weak near-uniform random attention hides it."""
    with torch.no_grad():
        for attention in [drafter.self_attn, *(layer.self_attn for layer in drafter.layers)]:
            for projection in ("q_proj", "k_proj", "v_proj"):
                getattr(attention, projection).weight.mul_(16.0)


@pytest.mark.parametrize("reduced,style,layers", [(False, "eagle3", 1), (True, "eagle3", 1), (False, "deepseek", 1),
                                                  (True, "eagle3", 2)])
def test_unrolled_chain_drafts_what_inference_drafts(targets, reduced, style, layers):
    target = targets.target("llama")
    sequence = targets.sequences("llama")[:1]
    torch.manual_seed(1)
    ids = torch.unique(sequence) if reduced else None
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3, draft_token_ids=ids, layer_style=style,
                                     num_hidden_layers=layers).eval()
    sharpen_attention(drafter)
    with torch.no_grad():
        chain = run_chain(target, drafter, sequence)
    for origin in range(PROMPT_LENGTH, sequence.shape[1] - 4):
        generator = MTPCandidateGenerator(drafter, target, GenerationConfig(max_length=200, do_sample=False), None)
        prefill = target(sequence[:, : origin + 1], output_hidden_states=True)
        candidates, _ = generator.get_candidates(sequence[:, : origin + 2], model_kwargs={}, model_outputs=prefill,
                                                 is_first_iteration=False, n_last_matches=0)
        assert candidates[0, origin + 2 :].tolist() == chain.draft_tokens[0, origin].tolist()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_grown_drafter_drafts_what_it_drafted_and_its_new_layers_learn(targets, qk_norm):
    target = targets.target("llama")
    sequences = targets.sequences("llama")[:2]
    torch.manual_seed(3)
    one = MTPDrafter.from_target(target, num_draft_tokens=3, draft_token_ids=torch.unique(sequences),
                                 qk_norm=qk_norm).eval()
    sharpen_attention(one)
    two = grow_mtp_layers(one, 2)
    three = grow_mtp_layers(two, 3)
    assert two.config.num_hidden_layers == 2 and len(three.layers) == 2
    with torch.no_grad():
        before = run_chain(target, one, sequences)
        for grown in (two, three):
            after = run_chain(target, grown, sequences)
            assert torch.equal(before.draft_tokens, after.draft_tokens)
            torch.testing.assert_close(before.alpha, after.alpha)
    result = run_chain(target, three.train(), sequences)
    result.loss.backward()
    for layer in three.layers:  # zeroed output projections receive gradient at once
        assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and layer.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="more layers"):
        grow_mtp_layers(two, 2)
    with pytest.raises(DrafterConfigError, match="deepseek-style"):
        grow_mtp_layers(MTPDrafter.from_target(target, layer_style="deepseek"), 2)


def test_rewired_drafter_keeps_what_it_drafted_and_its_new_layers_learn(targets):
    """Rewired to a superset of its target layers, a drafter drafts exactly as before (the new
    layers' fusion columns start at zero and get gradient); a layer moved by one keeps its
    columns; repeated layers and a deepseek-style drafter are refused."""
    target = targets.target("llama")
    sequences = targets.sequences("llama")[:2]
    torch.manual_seed(4)
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3, draft_token_ids=torch.unique(sequences)).eval()
    sharpen_attention(drafter)
    old = drafter.config.target_layer_ids
    unused = [i for i in range(target.config.num_hidden_layers) if i not in old]
    wider = rewire_mtp_target_layers(drafter, sorted([*old, *unused[:2]]))
    assert wider.config.target_layer_ids == sorted([*old, *unused[:2]]) and not wider.training
    with torch.no_grad():
        before, after = run_chain(target, drafter, sequences), run_chain(target, wider, sequences)
    assert torch.equal(before.draft_tokens, after.draft_tokens)
    torch.testing.assert_close(before.alpha, after.alpha)
    run_chain(target, wider.train(), sequences).loss.backward()
    size = drafter.config.hidden_size
    for layer in unused[:2]:
        index = wider.config.target_layer_ids.index(layer)
        assert wider.fc.weight.grad[:, index * size:(index + 1) * size].abs().sum() > 0
    moved_from = old[-1]
    moved_to = moved_from + 1 if moved_from + 1 < target.config.num_hidden_layers else moved_from - 1
    moved = rewire_mtp_target_layers(drafter, [*old[:-1], moved_to])
    assert torch.equal(moved.fc.weight, drafter.fc.weight)
    with pytest.raises(ValueError, match="repeats"):
        rewire_mtp_target_layers(drafter, [old[0], old[0]])
    with pytest.raises(DrafterConfigError, match="deepseek-style"):
        rewire_mtp_target_layers(MTPDrafter.from_target(target, layer_style="deepseek"), old)


def test_packed_documents_do_not_see_each_other(targets):
    target = targets.target("qwen3")
    torch.manual_seed(2)
    drafter = MTPDrafter.from_target(target, num_draft_tokens=2).eval()
    first, second = targets.sequences("qwen3")[0, :20], targets.sequences("qwen3")[1, :20]
    packed = torch.cat([first, second])[None]
    documents = torch.cat([torch.zeros(20), torch.ones(20)]).long()[None]
    out = target.base_model(packed, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    with torch.no_grad():
        packed_chain = chain_loss(drafter, features, packed, out.last_hidden_state, target.get_input_embeddings(),
                                  target.get_output_embeddings(), torch.tensor([0]), torch.tensor([40]),
                                  document_ids=documents)
        unpacked_chain = chain_loss(drafter, features, packed, out.last_hidden_state, target.get_input_embeddings(),
                                    target.get_output_embeddings(), torch.tensor([0]), torch.tensor([40]))
    # Chains of the first document are unaffected; the second document's differ once it is masked.
    assert torch.equal(packed_chain.draft_tokens[0, :18], unpacked_chain.draft_tokens[0, :18])
    assert not torch.allclose(packed_chain.alpha[0, 22:36], unpacked_chain.alpha[0, 22:36])
    # A chain is trained only while it stays in its document: those starting at positions 18 and 19 read
    # the second document's first tokens and were scored against its soft labels (depth 2: 17 + 2 = 19).
    crossing = torch.arange(39)[None].add(2).clamp(max=39)
    assert torch.equal(packed_chain.valid[0], unpacked_chain.valid[0] & (documents[0, :39] == documents[0, crossing[0]]))
    assert packed_chain.valid[0, 17] and not packed_chain.valid[0, 18:20].any() and packed_chain.valid[0, 20]


def test_ttt_switch_and_objectives(targets):
    target = targets.target("llama")
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3)
    sequences = targets.sequences("llama")[:2]
    assert run_chain(target, drafter, sequences).alpha.shape[-1] == 3
    assert run_chain(target, drafter, sequences, ttt=False).alpha.shape[-1] == 1
    result = run_chain(target, drafter, sequences, objective="tv")
    result.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    assert 0.0 <= result.loss.item() <= 1.0


@pytest.mark.parametrize("name,draft_vocab_size,layers", [("mtp-chat", None, None), ("mtp-chat", 48, 2),
                                                          ("mtp-chat-deepseek", None, None)])
def test_mtp_recipe_training_improves_tau(targets, tmp_path, name, draft_vocab_size, layers):
    target = targets.target("llama")
    sequences = targets.sequences("llama")
    rows = [{"input_ids": row.tolist(), "loss_start": PROMPT_LENGTH} for row in sequences]
    recipe = Recipe(name=name, num_draft_tokens=3, draft_vocab_size=draft_vocab_size, lk_steps=60, tv_steps=15,
                    batch_size=6, learning_rate=3e-3, logging_steps=5, num_hidden_layers=layers)
    train_drafter(target, rows, tmp_path, recipe, pad_token_id=0)
    loaded = AutoModel.from_pretrained(tmp_path / "final").eval()
    assert loaded.config.uses_reduced_vocab == (draft_vocab_size is not None)
    assert loaded.config.num_hidden_layers == (layers or 1)
    assert json.loads((tmp_path / "final" / "training_recipe.json").read_text())["num_hidden_layers"] == (layers or 1)
    assert loaded.config.layer_style == ("deepseek" if name.endswith("deepseek") else "eagle3")
    untrained = MTPDrafter.from_target(target, num_draft_tokens=3).eval()
    taus = {}
    for name, model in (("untrained", untrained), ("trained", loaded)):
        new_tokens = rounds = 0
        for row in sequences[:4]:
            prompt = row[None, :PROMPT_LENGTH]
            out = target.generate(prompt, assistant_model=model, max_new_tokens=30, do_sample=False, eos_token_id=None)
            assert torch.equal(out, target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None))
            new_tokens += out.shape[1] - PROMPT_LENGTH - 1
            rounds += model.last_speculation_stats.rounds
        taus[name] = new_tokens / rounds
    assert taus["trained"] > taus["untrained"] + 0.3, taus


def test_a_batch_without_a_trainable_chain_logs_no_nan(targets):
    """A row whose prompt fills it (loss from its last position) leaves no valid chain: its metrics were
    NaN and turned the logged averages NaN; now it reports none, and its loss is 0."""
    target = targets.target("llama")
    drafter = MTPDrafter.from_target(target, num_draft_tokens=2)
    row = targets.sequences("llama")[:1, :12]
    out = target.base_model(row, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    with torch.no_grad():
        result = chain_loss(drafter, features, row, out.last_hidden_state, target.get_input_embeddings(),
                            target.get_output_embeddings(), torch.tensor([12]), torch.tensor([12]))
    assert not result.valid.any() and result.metrics() == {} and result.loss.item() == 0.0
