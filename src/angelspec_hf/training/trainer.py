"""Drafter training with ``transformers.Trainer``: checkpointing, resume, logging, gradient
accumulation and ``accelerate launch`` multi-GPU come from the Trainer.

The frozen target is held by the trainer (never a submodule of the drafter, so it is never
saved) and run on the fly for features and soft labels, or once per row with a `FeatureCache`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
from transformers import Trainer, TrainerCallback

from .block import block_loss, sample_anchors
from .features import FeatureCache, run_target
from .losses import check_target_logits, target_logit_transform
from .mtp import chain_loss

logger = logging.getLogger(__name__)


class SequenceCollator:
    """Right-pads token sequences; keeps each row's length and where its loss starts."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
            mask[i, : len(row["input_ids"])] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "lengths": mask.sum(1),
            "loss_start": torch.tensor([row["loss_start"] for row in rows]),
        }


class DrafterTrainer(Trainer):
    """Trains an AngelSpec drafter against a frozen target with the LK or end-to-end TV objective.

    Block drafters (DFly family) train on ``num_anchors`` random blocks per row; MTP drafters on
    every chain origin, unrolled ``ttt_steps`` deep (or one step with ``ttt=False``).
    """

    def __init__(self, *args, target, objective: str = "lk", num_anchors: int = 16, eta: float = 3.0,
                 ttt: bool = True, feature_cache: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.target = target.eval().requires_grad_(False)
        self.objective, self.num_anchors, self.eta, self.ttt = objective, num_anchors, eta, ttt
        self.layer_ids = list(self.model.config.target_layer_ids)
        self.feature_cache = FeatureCache(feature_cache, self.target, self.layer_ids) if feature_cache else None
        self.target_transform = target_logit_transform(self.target.config)
        probe = torch.arange(3, 11, device=self.target.device)[None] % self.target.config.get_text_config().vocab_size
        check_target_logits(self.target, self.target_transform, probe)
        self._metric_sums: dict[str, float] = defaultdict(float)
        self._metric_count = 0
        self._anchor_step, self._anchor_batch = -1, 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        input_ids = inputs["input_ids"]
        if self.feature_cache is None:
            features, final = run_target(self.target, input_ids, inputs["attention_mask"], self.layer_ids)
        else:
            features, final = self.feature_cache.states(self.target, input_ids, inputs["attention_mask"],
                                                        inputs["lengths"], self.target.dtype)
        embed, lm_head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        # Autocast here rather than relying on accelerate's wrapped forward: the loss also calls the
        # drafter's correction head and logits outside its forward (the target side opts out).
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
            result = self._drafter_loss(model, inputs, features, final, embed, lm_head)
        metrics = result.metrics()
        for key, value in metrics.items():
            self._metric_sums[key] += value
        self._metric_count += bool(metrics)
        return (result.loss, result) if return_outputs else result.loss

    def _drafter_loss(self, model, inputs, features, final, embed, lm_head):
        input_ids = inputs["input_ids"]
        if hasattr(model.config, "block_size"):
            anchors = sample_anchors(inputs["loss_start"], inputs["lengths"], model.config.block_size,
                                     self.num_anchors, self._anchor_generator())
            return block_loss(model, features, input_ids, final, embed, lm_head, anchors,
                              objective=self.objective, eta=self.eta, target_transform=self.target_transform)
        return chain_loss(model, features, input_ids, final, embed, lm_head,
                          inputs["loss_start"], inputs["lengths"], ttt=self.ttt, objective=self.objective,
                          eta=self.eta, target_transform=self.target_transform)

    def _anchor_generator(self) -> torch.Generator:
        """The anchors' random source for this batch, from (seed, optimizer step, batch within the step):
        a run resumed from a checkpoint draws what the uninterrupted run drew. One generator seeded once
        is not in the checkpoint, and a resumed run replayed the first steps' anchors. Evaluation
        batches (the model not training) count apart, so they leave the training draws as they are."""
        step = self.state.global_step if self.model.training else -1 - self.state.global_step
        if step != self._anchor_step:
            self._anchor_step, self._anchor_batch = step, 0
        self._anchor_batch += 1
        return torch.Generator().manual_seed((self.args.seed * 1_000_003 + step) * 1_009 + self._anchor_batch)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._metric_count:
            logs.update({key: value / self._metric_count for key, value in self._metric_sums.items()})
            self._metric_sums.clear()
            self._metric_count = 0
        super().log(logs, *args, **kwargs)


class WallClockDeadline(TrainerCallback):
    """Ends training at the first step boundary past ``deadline`` (a `time.time()` value).

    For machines lent or rented for a fixed time: the stage stops early instead of being killed,
    so `train_drafter` still saves the drafter. The learning-rate schedule is not shortened: size
    ``max_steps`` to the time and keep this as the guard. The step each stage stopped at is logged
    and kept in ``stops`` (``None`` for a stage that ran to its end).

    ``stage_steps``: the planned steps of the stages this callback will see, in order (an LK stage
    then a TV stage, say). Each stage, when it begins, gets the share of the time left that its
    steps are of the steps left, so a slow start (loading, a first step that compiles) cannot eat
    a later stage's time: on an H200 (2026-12-04) an MTP run began training 140 s late and the TV
    stage that followed its LK stage got one step. Without it, the first stage may use all the time.
    """

    def __init__(self, deadline: float, stage_steps: list[int] | None = None):
        self.deadline = deadline
        self.stage_steps = [steps for steps in (stage_steps or []) if steps > 0]
        self.stops: list[int | None] = []
        self.stage_deadline = deadline

    @property
    def stopped_at(self) -> int | None:
        """The step the last stage stopped at (``None``: it ran to its end)."""
        return self.stops[-1] if self.stops else None

    def on_train_begin(self, args, state, control, **kwargs):
        stage = len(self.stops)
        self.stops.append(None)
        later = self.stage_steps[stage:]
        now = time.time()
        share = later[0] / sum(later) if later else 1.0
        self.stage_deadline = now + max(self.deadline - now, 0.0) * share
        logger.info("Stage %d begins with %.0f s until its deadline.", stage + 1, self.stage_deadline - now)

    def on_step_end(self, args, state, control, **kwargs):
        if time.time() >= self.stage_deadline and not control.should_training_stop:
            control.should_training_stop = True
            self.stops[-1] = state.global_step
            logger.warning("Wall-clock deadline reached: training stops at step %d of %d.", state.global_step, state.max_steps)
        return control
