"""Block (DFly-family) training: anchors, the block mask, train/inference agreement, the trainer."""

import copy
import json

import torch
from transformers import AutoModel

import pytest

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.training.block import block_attention_mask, block_loss, grow_layers, sample_anchors
from angelspec_hf.training.recipes import Recipe, train_drafter
from conftest import PROMPT_LENGTH
from fitting import target_features


def test_block_attention_mask_sees_context_before_anchor_and_own_block():
    mask = block_attention_mask(torch.tensor([[2, 4]]), block_size=2, context_length=5)[0, 0]
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_sample_anchors_stay_inside_each_row():
    anchors = sample_anchors(torch.tensor([3, 0]), torch.tensor([12, 7]), block_size=4, num_anchors=5,
                             generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 5)
    assert anchors[0].min() >= 3 and anchors[0].max() <= 9
    assert anchors[1].min() >= 1 and anchors[1].max() <= 4


def test_training_forward_matches_inference_forward(targets):
    """Many anchors in one masked forward give each block what inference computes for it alone."""
    target = targets.target("llama")
    torch.manual_seed(0)
    drafter = DFlyDrafter.from_target(target, block_size=4).eval()
    sequence = targets.sequences("llama")[:1]
    features = target_features(target, sequence, drafter.config.target_layer_ids)
    embed = target.get_input_embeddings()
    anchors = torch.tensor([[7, 15, 30]])
    length = sequence.shape[1]
    context_kv = drafter.context_keys_values(features, torch.arange(length)[None])
    positions = anchors[..., None] + torch.arange(4)
    ids = torch.full_like(positions, drafter.config.mask_token_id)
    ids[..., 0] = sequence.gather(1, anchors)
    with torch.no_grad():
        batched = drafter(embed(ids.flatten(1)), positions.flatten(1), context_kv,
                          block_attention_mask(anchors, 4, length)).view(1, 3, 4, -1)
        for index, anchor in enumerate(anchors[0].tolist()):
            alone_kv = drafter.context_keys_values([f[:, :anchor] for f in features], torch.arange(anchor)[None])
            alone = drafter(embed(ids[:, index]), positions[:, index], alone_kv)
            torch.testing.assert_close(batched[:, index], alone, atol=1e-5, rtol=1e-5)


def test_block_loss_objectives_have_gradients(targets):
    target = targets.target("qwen3")
    drafter = DFlyDrafter.from_target(target, block_size=4)
    sequence = targets.sequences("qwen3")[:2]
    out = target.base_model(sequence, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    anchors = sample_anchors(torch.tensor([PROMPT_LENGTH] * 2), torch.tensor([sequence.shape[1]] * 2), 4, 6)
    for objective in ("lk", "tv"):
        drafter.zero_grad()
        result = block_loss(drafter, features, sequence, out.last_hidden_state, target.get_input_embeddings(),
                            target.get_output_embeddings(), anchors, objective=objective)
        result.loss.backward()
        assert result.alpha.shape == (2, 6, 3)
        assert drafter.context_proj.weight.grad.abs().sum() > 0
        assert 1.0 <= result.metrics()["greedy_tau_estimate"] <= 4.0


def test_reduced_vocabulary_scores_draft_and_target_over_it(targets):
    """With a draft vocabulary the loss is the full-head loss of a target whose head has only those rows."""
    target = targets.target("qwen3")
    torch.manual_seed(0)
    drafter = DFlyDrafter.from_target(target, block_size=4)
    sequence = targets.sequences("qwen3")[:2]
    out = target.base_model(sequence, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    anchors = sample_anchors(torch.tensor([PROMPT_LENGTH] * 2), torch.tensor([sequence.shape[1]] * 2), 4, 6)
    ids = torch.unique(sequence)
    full_head = target.get_output_embeddings()
    subset_head = torch.nn.Linear(full_head.in_features, ids.numel(), bias=False)
    subset_head.weight = torch.nn.Parameter(full_head.weight[ids].detach())
    reduced = copy.deepcopy(drafter)
    reduced.set_draft_vocab(ids)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        for objective in ("lk", "tv"):
            expected = block_loss(drafter, features, sequence, out.last_hidden_state, embed, subset_head, anchors,
                                  objective=objective)
            got = block_loss(reduced, features, sequence, out.last_hidden_state, embed, full_head, anchors,
                             objective=objective)
            torch.testing.assert_close(got.loss, expected.loss)
            torch.testing.assert_close(got.alpha, expected.alpha)
            full = block_loss(drafter, features, sequence, out.last_hidden_state, embed, full_head, anchors,
                              objective=objective)
            assert not torch.allclose(full.alpha, got.alpha)


def test_two_stage_training_improves_the_drafter_and_saves_it(targets, tmp_path):
    target = targets.target("llama")
    sequences = targets.sequences("llama")
    rows = [{"input_ids": row.tolist(), "loss_start": PROMPT_LENGTH} for row in sequences]
    recipe = Recipe(name="dfly-code", block_size=4, num_hidden_layers=1, lk_steps=40, tv_steps=10, batch_size=6,
                         num_anchors=6, learning_rate=3e-3, logging_steps=5)
    drafter = train_drafter(target, rows, tmp_path, recipe, pad_token_id=0)
    for stage in ("lk", "final"):
        assert (tmp_path / stage / "model.safetensors").exists()
        assert json.loads((tmp_path / stage / "training_recipe.json").read_text())["name"] == "dfly-code"
    untrained = DFlyDrafter.from_target(target, block_size=4, num_hidden_layers=1).eval()
    loaded = AutoModel.from_pretrained(tmp_path / "final").eval()
    taus = {}
    for name, model in (("untrained", untrained), ("trained", loaded)):
        new_tokens = rounds = 0
        for row in sequences[:4]:
            out = target.generate(row[None, :PROMPT_LENGTH], assistant_model=model, max_new_tokens=30,
                                  do_sample=False, eos_token_id=None)
            assert torch.equal(out, target.generate(row[None, :PROMPT_LENGTH], max_new_tokens=30, do_sample=False,
                                                    eos_token_id=None))
            new_tokens += out.shape[1] - PROMPT_LENGTH - 1
            rounds += model.last_speculation_stats.rounds
        taus[name] = new_tokens / rounds
    assert taus["trained"] > taus["untrained"] + 0.3, taus
    assert drafter.config.variant == "dfly"


def test_mixed_precision_autocasts_the_drafter_but_not_the_target(targets, tmp_path):
    """``Recipe(bf16=True)``: the drafter's forward runs under bfloat16 autocast, the target's states
    and soft labels do not (they must be what inference sees), and the drafter still learns."""
    target = targets.target("llama")
    sequences = targets.sequences("llama")
    rows = [{"input_ids": row.tolist(), "loss_start": PROMPT_LENGTH} for row in sequences]
    # Over the full vocabulary the target's lm_head gives the drafter's logits (autocast) and the soft labels.
    seen = {"drafter": set(), "target": set(), "lm_head": set()}
    lm_head = target.get_output_embeddings()
    drafter = DFlyDrafter.from_target(target, block_size=4, num_hidden_layers=1)
    hooks = [drafter.register_forward_hook(lambda *args: seen["drafter"].add(torch.is_autocast_enabled("cpu"))),
             target.model.register_forward_hook(lambda *args: seen["target"].add(torch.is_autocast_enabled("cpu"))),
             lm_head.register_forward_hook(lambda module, args, out: seen["lm_head"].add(out.dtype))]
    try:
        recipe = Recipe(name="dfly-code", block_size=4, num_hidden_layers=1, lk_steps=30, tv_steps=0, batch_size=6,
                        num_anchors=6, learning_rate=3e-3, logging_steps=5, bf16=True)
        trained = train_drafter(target, rows, tmp_path, recipe, pad_token_id=0, drafter=drafter)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == {"drafter": {True}, "target": {False}, "lm_head": {torch.bfloat16, torch.float32}}, seen
    assert trained.dtype == torch.float32
    history = [entry["loss"] for entry in json.loads(
        next((tmp_path / "checkpoints-lk").glob("checkpoint-*/trainer_state.json")).read_text())["log_history"]
        if "loss" in entry]
    assert history[-1] < 0.8 * history[0], history


def test_train_command_passes_bf16_to_the_recipe(monkeypatch, tmp_path):
    """`angelspec-hf train --bf16` reaches the recipe; without the flag training stays float32."""
    train, seen = stubbed_train_command(monkeypatch, tmp_path)
    assert train("--bf16") == 0 and train() == 0
    assert [recipe.bf16 for recipe, _ in seen] == [True, False]


@pytest.mark.parametrize("native", [False, True])
def test_bf16_training_on_a_cpu_without_bfloat16_units_warns(monkeypatch, tmp_path, caplog, native):
    """Emulated bfloat16 made MTP steps 90 s against float32's 8 on an AVX2-only CPU: say so, with the fix."""
    import logging

    from angelspec_hf.training import recipes

    monkeypatch.setattr(recipes, "cpu_has_bfloat16_units", lambda: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="angelspec_hf.training.recipes"):
        recipes.training_arguments(recipes.Recipe(bf16=True), tmp_path, 10, 1e-3)
        recipes.training_arguments(recipes.Recipe(bf16=False), tmp_path, 10, 1e-3)
    assert ("drop --bf16" in caplog.text) == (not native)
    assert caplog.text.count("drop --bf16") <= 1


@pytest.mark.parametrize("kind", ["dfly-hybrid-corr-reduced", "dfly-global-nocorr", "dfly-layerwise-corr"])
def test_grown_drafter_drafts_what_it_grew_from_and_trains_its_new_layers(targets, tmp_path, kind):
    target, sequence = targets.target("llama"), targets.sequences("llama")[:2]
    drafter = targets.fitted("llama", kind)
    grown = grow_layers(drafter, drafter.config.num_hidden_layers + 2)
    assert grown.config.num_hidden_layers == len(grown.layers) == drafter.config.num_hidden_layers + 2
    assert drafter.config.num_hidden_layers == len(drafter.layers), "the drafter grown from is left as it was"
    out = target.base_model(sequence, output_hidden_states=[i + 1 for i in drafter.config.target_layer_ids])
    features = [out.hidden_states[i + 1] for i in drafter.config.target_layer_ids]
    anchors = sample_anchors(torch.tensor([PROMPT_LENGTH] * 2), torch.tensor([sequence.shape[1]] * 2), 8, 5,
                             generator=torch.Generator().manual_seed(0))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        before = block_loss(drafter, features, sequence, out.last_hidden_state, embed, head, anchors)
    after = block_loss(grown.train(), features, sequence, out.last_hidden_state, embed, head, anchors)
    torch.testing.assert_close(after.loss, before.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(after.greedy_match, before.greedy_match)
    after.loss.backward()
    new = grown.layers[-1]
    assert new.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0
    # The same drafts through generate, and a round trip through save_pretrained / AutoModel.
    prompt = sequence[:1, :PROMPT_LENGTH]
    grown.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert len(loaded.layers) == len(grown.layers)
    original = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=None)
    original_stats = drafter.last_speculation_stats.as_dict()
    again = target.generate(prompt, assistant_model=loaded, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(again, original)
    assert loaded.last_speculation_stats.as_dict() == original_stats


def test_grow_layers_refuses_fewer_layers_and_other_drafters(targets):
    target = targets.target("llama")
    drafter = DFlyDrafter.from_target(target, block_size=4)
    with pytest.raises(ValueError, match="more layers than the drafter's 2"):
        grow_layers(drafter, 2)
    with pytest.raises(TypeError, match="block"):
        grow_layers(MTPDrafter.from_target(target), 3)


def stubbed_train_command(monkeypatch, tmp_path):
    """``train(*flags)`` running `angelspec-hf train` on one rollout row with the target and the
    training itself stubbed out, and the ``(recipe, drafter)`` pairs it would have trained."""
    from types import SimpleNamespace

    from angelspec_hf import cli
    from angelspec_hf.training import recipes

    seen = []
    monkeypatch.setattr(cli, "load_target", lambda name: (object(), SimpleNamespace(eos_token_id=0)))
    monkeypatch.setattr(recipes, "train_drafter",
                        lambda target, rows, output, recipe, **kwargs: seen.append((recipe, kwargs["drafter"])))
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"prompt_ids": list(range(3, 9)), "response_ids": list(range(9, 60))}) + "\n")

    def train(*flags):
        args = cli.build_parser().parse_args(["train", "--data", str(rollouts), "--corpus-tokens", "0", "--eval-per-set",
                                              "0", "--output", str(tmp_path / "out"), *flags])
        return args.handler(args)

    return train, seen


def test_train_command_continues_and_grows_a_drafter(targets, monkeypatch, tmp_path):
    """`train --from DIR --grow-layers N` trains the saved drafter grown to N layers (recorded in the
    recipe); a drafter of another variant than the recipe, or growing without --from, is refused."""
    from angelspec_hf.errors import DrafterConfigError

    train, seen = stubbed_train_command(monkeypatch, tmp_path)
    saved = tmp_path / "dfly"
    targets.fitted("llama", "dfly-hybrid-corr").save_pretrained(saved)

    assert train("--recipe", "dfly-code", "--from", str(saved), "--grow-layers", "4") == 0
    recipe, drafter = seen[-1]
    assert recipe.num_hidden_layers == len(drafter.layers) == 4 and drafter.training
    assert drafter.dtype == torch.float32
    assert train("--recipe", "dfly-code", "--from", str(saved)) == 0
    assert seen[-1][0].num_hidden_layers == len(seen[-1][1].layers) == 2
    with pytest.raises(DrafterConfigError, match="dflash-code"):
        train("--recipe", "dflash-code", "--from", str(saved))
    with pytest.raises(SystemExit, match="--from"):
        train("--recipe", "dfly-code", "--grow-layers", "4")


def test_train_command_names_rows_too_short_to_train_on(monkeypatch, tmp_path, caplog):
    """Rollout rows with fewer than MIN_TRAINED_TOKENS response tokens are left out, and said so: with
    no row left, the error names the options that make them long enough, not a missing --data."""
    train, seen = stubbed_train_command(monkeypatch, tmp_path)
    with caplog.at_level("WARNING"):
        assert train("--recipe", "dfly-code") == 0  # the row's 51 response tokens are enough
    assert len(seen) == 1 and "Left out" not in caplog.text
    with caplog.at_level("WARNING"), pytest.raises(SystemExit, match="rollouts --max-new-tokens"):
        train("--recipe", "dfly-code", "--rollout-length", "30")
    assert "Left out 1 of 1 rows with fewer than 32 response tokens within the first 30" in caplog.text


def test_train_command_rewires_an_mtp_drafter_to_other_target_layers(targets, monkeypatch, tmp_path):
    """`train --from DIR --target-layers ...` rewires an MTP drafter's fusion (recorded in the recipe,
    with --weight-decay); a block drafter is refused with the fix; a malformed list is an argparse error;
    the feature cache the rollouts and corpus commands fill keeps the layers given."""
    from angelspec_hf import MTPDrafter, cli
    from angelspec_hf.errors import DrafterConfigError
    from angelspec_hf.training import recipes

    train, seen = stubbed_train_command(monkeypatch, tmp_path)
    target = targets.target("llama")
    MTPDrafter.from_target(target).save_pretrained(tmp_path / "mtp")
    targets.fitted("llama", "dfly-hybrid-corr").save_pretrained(tmp_path / "dfly")

    assert train("--recipe", "mtp-chat", "--from", str(tmp_path / "mtp"), "--target-layers", "0,1,2,3",
                 "--weight-decay", "0.05") == 0
    recipe, drafter = seen[-1]
    assert recipe.target_layer_ids == drafter.config.target_layer_ids == [0, 1, 2, 3]
    assert drafter.fc.in_features == 4 * drafter.config.hidden_size and recipe.weight_decay == 0.05
    assert recipes.training_arguments(recipe, tmp_path / "args", 10, 1e-3).weight_decay == 0.05
    with pytest.raises(DrafterConfigError, match="per-layer conditioning"):
        train("--recipe", "dfly-code", "--from", str(tmp_path / "dfly"), "--target-layers", "0,1")
    with pytest.raises(SystemExit):
        train("--recipe", "mtp-chat", "--target-layers", "1,x")
    caches = cli.recipe_feature_caches(target, str(tmp_path / "cache"), ["mtp-chat", "dfly-code"], [0, 2])
    assert [cache.layer_ids for cache in caches.values()] == [[0, 2], [0, 2]]
    assert cli.recipe_feature_caches(target, str(tmp_path / "cache"), ["mtp-chat"])["mtp-chat"].layer_ids == \
        MTPDrafter.from_target(target).config.target_layer_ids


def test_wall_clock_deadline_stops_a_stage_early_and_the_drafter_is_still_saved(targets, tmp_path):
    """`WallClockDeadline` ends the stage at the next step boundary once its time has passed, and
    `train_drafter` saves what was trained; a deadline not reached changes nothing."""
    import time

    from angelspec_hf.training.trainer import WallClockDeadline

    target = targets.target("llama")
    rows = [{"input_ids": row.tolist(), "loss_start": PROMPT_LENGTH} for row in targets.sequences("llama")]
    recipe = Recipe(name="dflash-code", block_size=4, num_hidden_layers=1, lk_steps=20, tv_steps=0, batch_size=2,
                    num_anchors=4, logging_steps=1)
    passed, later = WallClockDeadline(time.time() - 1), WallClockDeadline(time.time() + 3600)
    train_drafter(target, rows, tmp_path / "stopped", recipe, pad_token_id=0, callbacks=[passed])
    train_drafter(target, rows, tmp_path / "full", recipe, pad_token_id=0, callbacks=[later])
    assert passed.stopped_at == 1 and later.stopped_at is None
    stopped, full = (AutoModel.from_pretrained(tmp_path / run / "final") for run in ("stopped", "full"))
    assert any(not torch.equal(a, b) for a, b in zip(stopped.parameters(), full.parameters()))


def test_wall_clock_deadline_gives_each_stage_its_share_of_the_time_left(monkeypatch):
    """With the stages' planned steps, a stage that begins late leaves the next one its share: the
    LK stage of 80 + 20 planned steps gets 80% of the time left when it begins, the TV stage all
    that is left then. Without them the first stage may use everything (the old behaviour)."""
    from types import SimpleNamespace

    from angelspec_hf.training import trainer as trainer_module
    from angelspec_hf.training.trainer import WallClockDeadline

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(trainer_module.time, "time", lambda: clock.now)

    def step_end(guard, at, step):
        clock.now = at
        control = SimpleNamespace(should_training_stop=False)
        guard.on_step_end(None, SimpleNamespace(global_step=step, max_steps=100), control)
        return control.should_training_stop

    shared = WallClockDeadline(1000.0, [80, 20])
    clock.now = 100.0  # the stage begins late
    shared.on_train_begin(None, None, None)
    assert shared.stage_deadline == 100.0 + 900.0 * 0.8
    assert not step_end(shared, 819.0, 50) and step_end(shared, 820.0, 51)
    clock.now = 830.0
    shared.on_train_begin(None, None, None)
    assert shared.stage_deadline == 1000.0
    assert not step_end(shared, 999.0, 10) and step_end(shared, 1000.0, 11)
    assert shared.stops == [51, 11] and shared.stopped_at == 11

    alone = WallClockDeadline(1000.0)
    clock.now = 100.0
    alone.on_train_begin(None, None, None)
    assert not step_end(alone, 999.0, 90) and alone.stops == [None]
    assert WallClockDeadline(1000.0, [80, 0]).stage_steps == [80]


def test_a_block_run_resumed_from_a_checkpoint_trains_as_the_uninterrupted_run(tmp_path):
    """The anchors' random source was one generator seeded once and not checkpointed: a resumed run
    replayed the first steps' anchors and ended on other weights than the same run uninterrupted."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from angelspec_hf.reference import tiny_target
    from angelspec_hf.training.recipes import new_drafter, training_arguments
    from angelspec_hf.training.trainer import DrafterTrainer, SequenceCollator

    target = tiny_target("llama", seed=0).requires_grad_(False)
    ids = torch.randint(3, 96, (8, 30), generator=torch.Generator().manual_seed(4))
    rows = Dataset.from_list([{"input_ids": row.tolist(), "loss_start": 6} for row in ids])
    recipe = Recipe(name="dfly-code", block_size=4, batch_size=2, num_anchors=3, learning_rate=3e-3, warmup_steps=0,
                    logging_steps=1)

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    def run(out, stop=False, resume=False):
        torch.manual_seed(recipe.seed)
        drafter = new_drafter(target, recipe)
        args = training_arguments(recipe, out, 4, recipe.learning_rate)
        args.save_steps, args.save_total_limit = 2, None
        trainer = DrafterTrainer(model=drafter, args=args, train_dataset=rows, data_collator=SequenceCollator(0),
                                 target=target, objective="lk", num_anchors=recipe.num_anchors, eta=recipe.eta,
                                 callbacks=[StopAt()] if stop else None)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2") if resume else None)
        return drafter.state_dict()

    uninterrupted = run(tmp_path / "a")
    run(tmp_path / "b", stop=True)
    resumed = run(tmp_path / "b", resume=True)
    assert all(torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted)


def test_rows_without_room_for_a_block_are_left_out_not_the_end_of_the_run(tmp_path, caplog):
    from angelspec_hf.reference import tiny_target

    target = tiny_target("llama", seed=0).requires_grad_(False)
    ids = torch.randint(3, 96, (4, 30), generator=torch.Generator().manual_seed(4))
    rows = [{"input_ids": row.tolist(), "loss_start": 6} for row in ids]
    rows.append({"input_ids": ids[0, :12].tolist(), "loss_start": 6})  # 6 trained tokens: no block of 8 fits
    recipe = Recipe(name="dfly-code", block_size=8, batch_size=5, num_anchors=2, lk_steps=2, tv_steps=1,
                    warmup_steps=0, logging_steps=1)
    with caplog.at_level("WARNING"):
        train_drafter(target, rows, tmp_path / "a", recipe, pad_token_id=0)
    assert "Left out 1 of 5 rows too short for a block of 8" in caplog.text
    with pytest.raises(ValueError, match="smaller --block-size"):
        train_drafter(target, rows[-1:], tmp_path / "b", recipe, pad_token_id=0)
