"""Training recipes: named drafter configurations plus the two-stage schedule.

Stage 1 (``lk``) pulls the drafter towards the target with the LK loss and D-PACE position
weights; stage 2 (``tv``) maximises the expected accepted length directly with the end-to-end TV
loss. The resolved recipe is saved beside the weights as ``training_recipe.json``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainingArguments

from ..errors import DrafterConfigError
from ..modeling_angelspec_common import cpu_has_bfloat16_units
from ..modeling_angelspec_dfly import DFlyDrafter
from ..modeling_angelspec_mtp import MTPDrafter
from .block import grow_layers
from .mtp import grow_mtp_layers, rewire_mtp_target_layers
from .trainer import DrafterTrainer, SequenceCollator

logger = logging.getLogger(__name__)

# name -> (drafter family, drafter config overrides, trainer options)
RECIPES = {
    "dfly-code": ("dfly", {"conditioning": "hybrid", "hidden_correction": True}, {}),
    "dflash-code": ("dfly", {"conditioning": "global", "hidden_correction": False}, {}),
    "dflare-code": ("dfly", {"conditioning": "layerwise", "hidden_correction": False}, {}),
    "mtp-chat": ("mtp", {}, {"ttt": True}),
    "mtp-chat-nottt": ("mtp", {}, {"ttt": False}),
    # AngelSpec's MTPDraftModel layer (DeepSeek-V3 style, last hidden state only); exports with --to angelspec.
    "mtp-chat-deepseek": ("mtp", {"layer_style": "deepseek"}, {"ttt": True}),
}


# Decoder layers of a new drafter when the recipe does not say: block drafters need depth for a
# whole block at once; the MTP drafter is EAGLE-3's single layer unless asked for more.
DEFAULT_LAYERS = {"dfly": 2, "mtp": 1}


@dataclass
class Recipe:
    """One training run. ``block_size`` applies to block drafters, ``num_draft_tokens`` (also the
    TTT depth) to MTP drafters, ``num_hidden_layers`` (``None``: 2 for block drafters, 1 for MTP)
    and ``draft_vocab_size`` to both (MTP learns its own reduced head; DFly drafts with those rows
    of the target's head). ``target_layer_ids`` (``None``: the family's default) are the target
    decoder layers the drafter reads; ``weight_decay`` is AdamW's decoupled decay."""

    name: str = "dfly-code"
    block_size: int = 8
    num_hidden_layers: int | None = None
    num_draft_tokens: int = 3
    draft_vocab_size: int | None = None
    target_layer_ids: list[int] | None = None
    lk_steps: int = 400
    tv_steps: int = 100
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    num_anchors: int = 24
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    eta: float = 3.0
    seed: int = 0
    logging_steps: int = 10
    feature_cache: str | None = None  # directory for target states computed once per row (see FeatureCache)
    # Mixed precision: the drafter's matmuls in bfloat16 (autocast); weights, optimiser and losses
    # stay float32, and the target's states and soft labels are computed without autocast, as
    # inference sees them. Measured on this CPU (AMX), one thread: DFly steps 1.4x, MTP-TTT3 steps 1.6x faster.
    bf16: bool = False


def training_arguments(recipe: Recipe, output_dir: Path, steps: int, learning_rate: float) -> TrainingArguments:
    if recipe.bf16 and not torch.cuda.is_available() and not cpu_has_bfloat16_units():
        # Measured on an AVX2-only EPYC: an MTP-TTT3 step took 90 s under --bf16 against 8 s in float32.
        logger.warning("Mixed precision (--bf16) on a CPU without bfloat16 units (AVX2 only) is about 10x slower "
                       "than float32 here. Fix: drop --bf16 on this machine.")
    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        max_steps=steps,
        learning_rate=learning_rate,
        warmup_steps=min(recipe.warmup_steps, max(steps // 10, 1)),
        lr_scheduler_type="cosine",
        weight_decay=recipe.weight_decay,
        max_grad_norm=1.0,
        logging_steps=recipe.logging_steps,
        save_strategy="steps",
        save_steps=max(steps // 4, 50),
        save_total_limit=1,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=recipe.seed,
        bf16=recipe.bf16,
    )


def new_drafter(target, recipe: Recipe, token_counts: torch.Tensor | None = None):
    """A fresh drafter of the recipe's family, sized for ``target``.

    A reduced vocabulary keeps the ``draft_vocab_size`` most frequent tokens of ``token_counts``.
    """
    family, overrides, _ = RECIPES[recipe.name]
    if recipe.num_hidden_layers is None:
        recipe.num_hidden_layers = DEFAULT_LAYERS[family]
    if recipe.target_layer_ids is not None:
        overrides = {**overrides, "target_layer_ids": list(recipe.target_layer_ids)}
    ids = None
    if recipe.draft_vocab_size is not None and token_counts is not None:
        ids = frequent_token_ids(token_counts, recipe.draft_vocab_size)
    if family == "dfly":
        if recipe.draft_vocab_size is not None and ids is None:
            ids = torch.arange(recipe.draft_vocab_size)
        return DFlyDrafter.from_target(target, block_size=recipe.block_size, draft_token_ids=ids,
                                       num_hidden_layers=recipe.num_hidden_layers, **overrides)
    return MTPDrafter.from_target(target, num_draft_tokens=recipe.num_draft_tokens,
                                  draft_vocab_size=None if ids is not None else recipe.draft_vocab_size,
                                  draft_token_ids=ids, num_hidden_layers=recipe.num_hidden_layers, **overrides)


def continued_drafter(path: str | os.PathLike, recipe: Recipe, grow_to: int | None = None):
    """A trained drafter from ``path`` to continue with ``recipe``, in float32 for training.

    ``grow_to`` appends layers that start as the identity (`grow_layers` for block drafters,
    `grow_mtp_layers` for MTP ones), so a trained drafter gains capacity without starting over.
    The recipe's ``target_layer_ids``, when they differ from the drafter's, rewire an MTP drafter's
    fusion (`rewire_mtp_target_layers`); a block drafter's per-layer conditioning cannot be carried
    over and is refused. A drafter of another family or variant than the recipe trains is refused:
    its switches, not the recipe's, would be trained.
    """
    from transformers import AutoModel

    drafter = AutoModel.from_pretrained(path).float().train()
    family, overrides, _ = RECIPES[recipe.name]
    expected = DFlyDrafter if family == "dfly" else MTPDrafter
    differing = {key: getattr(drafter.config, key, None) for key, value in overrides.items()
                 if getattr(drafter.config, key, None) != value}
    if not isinstance(drafter, expected) or differing:
        raise DrafterConfigError(
            f"{path} holds a {type(drafter).__name__} ({differing or 'another family'}) that recipe {recipe.name!r} "
            f"does not train ({expected.__name__} with {overrides}); continue it with the recipe it was trained with.")
    wanted = recipe.target_layer_ids
    if wanted is not None and list(wanted) != list(drafter.config.target_layer_ids):
        if family == "dfly":
            raise DrafterConfigError(
                f"{path} reads target layers {drafter.config.target_layer_ids}, not {list(wanted)}: a block drafter's "
                "per-layer conditioning cannot be moved to other layers. Fix: continue it on its own layers (drop the "
                "target layers option), or train a new drafter on the new ones (drop --from).")
        drafter = rewire_mtp_target_layers(drafter, wanted)
    if grow_to is not None:
        drafter = (grow_layers if family == "dfly" else grow_mtp_layers)(drafter, grow_to)
    recipe.num_hidden_layers = drafter.config.num_hidden_layers
    recipe.target_layer_ids = list(drafter.config.target_layer_ids)
    return drafter


def frequent_token_ids(counts: torch.Tensor, size: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent token ids (of ``among`` only, when given); ties (unseen tokens
    above all) go to lower ids, which byte-pair vocabularies give to more frequent merges."""
    if among is None:
        return torch.argsort(counts, descending=True, stable=True)[:size]
    among = torch.sort(among.to(counts.device)).values
    return among[torch.argsort(counts[among], descending=True, stable=True)[:size]]


def token_counts(rows: list[dict], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the rows' trained (response) positions.

    One bincount over all rows: a vocabulary-sized add per row cost 0.1 ms each here but, with two
    training processes of 16 busy-waiting threads on a GPU machine, far more (9880 rows: the
    likeliest cause of a 140 s start, 2026-12-04)."""
    trained = [token for row in rows for token in row["input_ids"][row["loss_start"]:]]
    counts = torch.bincount(torch.tensor(trained, dtype=torch.long), minlength=vocab_size)
    if counts.numel() > vocab_size:
        raise ValueError(f"Training rows hold token id {counts.numel() - 1}, outside the target's vocabulary of "
                         f"{vocab_size}. Fix: make the rows with this target's tokenizer.")
    return counts


def train_drafter(
    target, train_rows: list[dict], output_dir: str | os.PathLike, recipe: Recipe,
    pad_token_id: int, finish_rows: list[dict] | None = None, resume: bool = False,
    drafter=None, callbacks: list | None = None,
):
    """Train a drafter for ``target``; saves ``output_dir/lk`` and ``output_dir/final``.

    ``train_rows`` feed the LK stage, ``finish_rows`` (default: the same) the TV stage: target
    rollouts are the natural finish because they match the deployed distribution. A ``drafter``
    given continues training (for example the TV stage alone on data that arrived later);
    ``callbacks`` (``transformers.TrainerCallback``) join every stage's Trainer, for example
    `WallClockDeadline` on a machine rented by the hour.
    """
    if recipe.name not in RECIPES:
        raise ValueError(f"unknown recipe {recipe.name!r}; choose one of {sorted(RECIPES)}.")
    output_dir = Path(output_dir)
    torch.manual_seed(recipe.seed)
    if drafter is None:
        drafter = new_drafter(target, recipe, token_counts(train_rows, target.config.get_text_config().vocab_size))
    trainer_options = RECIPES[recipe.name][2]
    collator = SequenceCollator(pad_token_id)
    block_size = getattr(drafter.config, "block_size", None)
    if block_size is not None:
        train_rows = rows_with_room(train_rows, block_size)
        finish_rows = rows_with_room(finish_rows, block_size) if finish_rows else None
    stages = [("lk", recipe.lk_steps, Dataset.from_list(train_rows), recipe.learning_rate),
              ("tv", recipe.tv_steps, Dataset.from_list(finish_rows or train_rows), recipe.learning_rate / 3)]
    for objective, steps, dataset, learning_rate in stages:
        if steps <= 0:
            continue
        stage_dir = output_dir / f"checkpoints-{objective}"
        trainer = DrafterTrainer(
            model=drafter, args=training_arguments(recipe, stage_dir, steps, learning_rate), train_dataset=dataset,
            data_collator=collator, target=target, objective=objective, num_anchors=recipe.num_anchors, eta=recipe.eta,
            feature_cache=recipe.feature_cache, callbacks=callbacks, **trainer_options,
        )
        checkpoint = resume and any(stage_dir.glob("checkpoint-*"))
        trainer.train(resume_from_checkpoint=True if checkpoint else None)
        save_drafter(drafter.eval(), output_dir / ("lk" if objective == "lk" else "final"), recipe, objective)
        drafter.train()
    if recipe.tv_steps <= 0:
        save_drafter(drafter.eval(), output_dir / "final", recipe, "lk")
    return drafter.eval()


def rows_with_room(rows: list[dict], block_size: int) -> list[dict]:
    """The rows whose trained part holds a block (`sample_anchors` needs one anchor with ``block_size``
    positions after it); the others are left out, and counted, instead of ending the run mid-way
    when a batch draws one (rows are only sure to hold `MIN_TRAINED_TOKENS`)."""
    kept = [row for row in rows if len(row["input_ids"]) - max(int(row["loss_start"]), 1) + 1 >= block_size]
    if not kept:
        raise ValueError(f"No training row has room for a block of {block_size} after its prompt. Fix: a smaller "
                         "--block-size, or longer rows (rollouts --max-new-tokens, --rollout-length).")
    if len(kept) < len(rows):
        logger.warning("Left out %d of %d rows too short for a block of %d after their prompts.",
                       len(rows) - len(kept), len(rows), block_size)
    return kept


def save_drafter(drafter, path: Path, recipe: Recipe, last_stage: str) -> None:
    drafter.save_pretrained(path)
    (path / "training_recipe.json").write_text(json.dumps({**asdict(recipe), "last_stage": last_stage}, indent=2))
