"""MTP training with training-time test: train/inference agreement, packing, the trainer."""

import pytest
import torch
from transformers import AutoModel, GenerationConfig

from angelspec_hf import MTPDrafter
from angelspec_hf.modeling_angelspec_mtp import MTPCandidateGenerator
from angelspec_hf.training.mtp import chain_loss
from angelspec_hf.training.recipes import Recipe, train_drafter
from conftest import PROMPT_LENGTH


def run_chain(target, drafter, sequences, **kwargs):
    out = target.base_model(sequences, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    batch, length = sequences.shape
    return chain_loss(drafter, features, sequences, out.last_hidden_state, target.get_input_embeddings(),
                      target.get_output_embeddings(), torch.full((batch,), PROMPT_LENGTH), torch.full((batch,), length),
                      **kwargs)


@pytest.mark.parametrize("reduced,style", [(False, "eagle3"), (True, "eagle3"), (False, "deepseek")])
def test_unrolled_chain_drafts_what_inference_drafts(targets, reduced, style):
    target = targets.target("llama")
    sequence = targets.sequences("llama")[:1]
    torch.manual_seed(1)
    ids = torch.unique(sequence) if reduced else None
    drafter = MTPDrafter.from_target(target, num_draft_tokens=3, draft_token_ids=ids, layer_style=style).eval()
    with torch.no_grad():
        # Sharp, strong attention, so that a draft step placed one position off (as inference once
        # did) changes which tokens the chain drafts; weak near-uniform random attention hides it.
        for projection in ("q_proj", "k_proj", "v_proj"):
            getattr(drafter.self_attn, projection).weight.mul_(16.0)
        chain = run_chain(target, drafter, sequence)
    for origin in range(PROMPT_LENGTH, sequence.shape[1] - 4):
        generator = MTPCandidateGenerator(drafter, target, GenerationConfig(max_length=200, do_sample=False), None)
        prefill = target(sequence[:, : origin + 1], output_hidden_states=True)
        candidates, _ = generator.get_candidates(sequence[:, : origin + 2], model_kwargs={}, model_outputs=prefill,
                                                 is_first_iteration=False, n_last_matches=0)
        assert candidates[0, origin + 2 :].tolist() == chain.draft_tokens[0, origin].tolist()


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


@pytest.mark.parametrize("name,draft_vocab_size", [("mtp-chat", None), ("mtp-chat", 48), ("mtp-chat-deepseek", None)])
def test_mtp_recipe_training_improves_tau(targets, tmp_path, name, draft_vocab_size):
    target = targets.target("llama")
    sequences = targets.sequences("llama")
    rows = [{"input_ids": row.tolist(), "loss_start": PROMPT_LENGTH} for row in sequences]
    recipe = Recipe(name=name, num_draft_tokens=3, draft_vocab_size=draft_vocab_size, lk_steps=60, tv_steps=15,
                    batch_size=6, learning_rate=3e-3, logging_steps=5)
    train_drafter(target, rows, tmp_path, recipe, pad_token_id=0)
    loaded = AutoModel.from_pretrained(tmp_path / "final").eval()
    assert loaded.config.uses_reduced_vocab == (draft_vocab_size is not None)
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
