"""The GPU example's pieces that run anywhere (examples/gpu_rollouts_and_train.py): padded batch
generation for rollouts, step sizing from the smoke report, and waiting for late weights."""

import json
from pathlib import Path

import pytest
import torch

from angelspec_hf.reference import tiny_target
from angelspec_hf.training.data import strip_after_eos


@pytest.fixture
def gpu_example(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    import gpu_rollouts_and_train

    return gpu_rollouts_and_train


def test_a_left_padded_batch_continues_each_prompt_as_its_own_greedy_generate(gpu_example):
    target = tiny_target("llama")
    prefixes = [[5, 9, 11, 40], [7, 3], [12, 13, 14, 15, 16, 17, 18], [60]]
    alone = target.generate(torch.tensor([prefixes[0]]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = alone[0, len(prefixes[0]) + 3].item()  # a token row 0 drafts early, so that some row stops at it
    expected = []
    for prefix in prefixes:
        ids = torch.tensor([prefix])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
        expected.append(strip_after_eos(out[0, len(prefix):].tolist(), eos))
    got = gpu_example.continuations(target, prefixes, 12, eos, do_sample=False)
    assert got == expected
    assert got[0][-1] == eos and len(got[0]) <= 4, "row 0 ends at its EOS, the padding after it dropped"


def test_steps_are_sized_by_the_slower_drafter_and_two_runs_sharing_the_gpu(gpu_example, tmp_path):
    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps({"dfly-code_seconds_per_step": 0.5, "dflash-code_seconds_per_step": 0.25}))
    assert gpu_example.affordable_steps(smoke, 300, sharing=2.0) == 300
    assert gpu_example.affordable_steps(smoke, 1, sharing=2.0) == 10


def test_weights_that_never_arrive_end_the_job_with_their_paths(gpu_example, tmp_path):
    missing = tmp_path / "modeling" / "model.safetensors"
    with pytest.raises(SystemExit, match="did not arrive"):
        gpu_example.wait_for_weights([missing], timeout=0)
