"""The Space's generation helpers, without Gradio: rounds streamed from generate match the drafter's stats."""

import torch

from angelspec_hf.demo import RunView, compare, engine_view, generate_view, segments
from fitting import tiny_tokenizer


def test_streamed_rounds_are_the_verify_rounds(targets):
    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-hybrid-corr")
    prompt = targets.sequences("llama")[:1, :6]
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    views = [RunView(**vars(v)) for v in generate_view(target, inputs, 24, drafter)]
    final = views[-1]
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)[0, 6:].tolist()
    assert final.token_ids == plain
    stats = drafter.last_speculation_stats
    assert final.accepted_per_round[0] == 0 and final.accepted_per_round[1:] == stats.accepted
    assert final.tau == stats.tau and sum(final.drafted) == sum(stats.accepted) > 0
    assert len(views) == len(final.accepted_per_round) + 1  # one view per round, then the final one


def test_segments_mark_accepted_drafts_and_keep_spacing():
    tokenizer = tiny_tokenizer()
    view = RunView()
    view.add_round([11, 12, 13], speculative=True)  # two accepted drafts, then the target's token
    view.add_round([14], speculative=True)
    pieces = segments(tokenizer, view)
    assert [label for _, label in pieces] == ["accepted draft", None]
    assert "".join(text for text, _ in pieces) == tokenizer.decode([11, 12, 13, 14], skip_special_tokens=True)


def test_compare_and_the_router_view(targets):
    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    drafters = {"dfly": targets.fitted("llama", "dfly-hybrid-corr"), "mtp": targets.fitted("llama", "mtp")}
    result = compare(target, tokenizer, "Add two numbers.", drafters["dfly"], max_new_tokens=12)
    assert result.identical and result.plain_text == result.speculative_text
    from angelspec_hf.evaluation import chat_inputs

    inputs = chat_inputs(tokenizer, "Add two numbers.")
    lengths = []
    for routed in engine_view(target, inputs, 12, drafters):
        lengths.append(len(routed.token_ids))
    plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert routed.token_ids == plain and len(routed.drafted) == len(plain)
    # Streamed round by round: one view per verify round, each round at least the target's token.
    assert len(lengths) == len(routed.accepted_per_round) - 1 and lengths == sorted(set(lengths))
    assert routed.accepted_per_round[0] == 0 and sum(a + 1 for a in routed.accepted_per_round) == len(plain)
    assert any(a > 0 for a in routed.accepted_per_round), "the router's drafts are accepted"
