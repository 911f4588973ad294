"""Fit tiny drafters to tiny targets so that their drafts really get accepted.

Test-only teacher-forced fitting (the real recipes, with TTT and the AngelSpec losses, belong to
the training package). It reuses the drafters' inference forwards, so what is fitted here is
exactly what generate runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from angelspec_hf import DFlyDrafter, MTPDrafter


def target_sequences(target, num_sequences: int, prompt_length: int, new_tokens: int, seed: int) -> torch.Tensor:
    """Random prompts continued greedily by the target: (num_sequences, prompt + new)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(3, vocab, (num_sequences, prompt_length), generator=generator)
    with torch.no_grad():
        return target.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )


def target_features(target, sequences: torch.Tensor, layer_ids: list[int]) -> list[torch.Tensor]:
    with torch.no_grad():
        hidden = target(sequences, output_hidden_states=[i + 1 for i in layer_ids]).hidden_states
    return [hidden[i + 1] for i in layer_ids]


def fit_mtp(drafter: MTPDrafter, target, sequences: torch.Tensor, prompt_length: int, steps: int = 150, lr: float = 3e-3):
    """Teacher-forced first draft step: pair (f_t, x_{t+1}) predicts x_{t+2}."""
    features = target_features(target, sequences, drafter.config.target_layer_ids)
    embeds = target.get_input_embeddings()(sequences).detach()
    lm_head = target.get_output_embeddings()
    length = sequences.shape[1]
    positions = torch.arange(length - 1)[None].expand(sequences.shape[0], -1)
    mask = torch.ones(length - 1, length - 1, dtype=torch.bool).tril()[None, None]
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    drafter.train()
    for _ in range(steps):
        fused = drafter.fuse([f[:, :-1] for f in features])
        hidden, _ = drafter(fused, embeds[:, 1:], positions, None, mask)
        logits = drafter.logits(hidden[:, prompt_length - 2 : -1], lm_head)
        labels = sequences[:, prompt_length:]
        loss = _cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def fit_dfly(drafter: DFlyDrafter, target, sequences: torch.Tensor, prompt_length: int, steps: int = 150, lr: float = 3e-3):
    """Random anchors inside the continuation; the correction head is teacher-forced."""
    config = drafter.config
    features = target_features(target, sequences, config.target_layer_ids)
    embed = target.get_input_embeddings()
    lm_head = target.get_output_embeddings()
    block = config.block_size
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    drafter.train()
    length = sequences.shape[1]
    for _ in range(steps):
        anchor = int(torch.randint(prompt_length, length - block + 1, (1,), generator=generator))
        context_kv = drafter.context_keys_values([f[:, :anchor] for f in features], torch.arange(anchor)[None])
        block_ids = sequences[:, anchor : anchor + block].clone()
        block_ids[:, 1:] = config.mask_token_id
        positions = torch.arange(anchor, anchor + block)[None].expand(sequences.shape[0], -1)
        z = drafter(embed(block_ids).detach(), positions, context_kv)
        previous = embed(sequences[:, anchor : anchor + block - 1]).detach()
        logits = drafter.logits(drafter.correct(z[:, 1:], previous), lm_head)
        loss = _cross_entropy(logits, sequences[:, anchor + 1 : anchor + block])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def tiny_tokenizer(vocab_size: int = 96):
    """A word-level tokenizer (``<unk> <s> </s> w3 .. w{V-1}``) with a chat template, for tiny targets."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5 {% endif %}"
    )
    return tokenizer


def same_generation(target, a, b, prompt: torch.Tensor | None = None) -> bool:
    """Drafters ``a`` and ``b`` give the same greedy tokens and the same acceptance on one prompt."""
    prompt = torch.tensor([[5, 17, 33, 2, 61, 8]]) if prompt is None else prompt
    first = target.generate(prompt, assistant_model=a, max_new_tokens=20, do_sample=False, eos_token_id=None)
    stats = a.last_speculation_stats.as_dict()
    second = target.generate(prompt, assistant_model=b, max_new_tokens=20, do_sample=False, eos_token_id=None)
    return torch.equal(first, second) and b.last_speculation_stats.as_dict() == stats
