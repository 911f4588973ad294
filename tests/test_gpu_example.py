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


def test_steps_are_sized_by_the_runs_of_the_job_kind_and_a_smoke_of_another_kind_is_refused(gpu_example, tmp_path):
    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps({"mtp-chat_seconds_per_step": 0.4, "mtp-chat-nottt_seconds_per_step": 0.2}))
    assert gpu_example.affordable_steps(smoke, 400, sharing=2.0, runs=gpu_example.KINDS["mtp"].runs) == 500
    with pytest.raises(SystemExit, match="dfly-code"):
        gpu_example.affordable_steps(smoke, 400, sharing=2.0)
    assert gpu_example.stage_steps(500, 0.2) == (400, 100)
    assert gpu_example.stage_steps(500, 0.0) == (500, 0)


def test_a_job_is_packed_with_the_candidates_lk_checkpoint_in_parts_that_come_back_whole(gpu_example, tmp_path, monkeypatch):
    import tarfile

    job = tmp_path / "job"
    for name in gpu_example.KINDS["mtp"].runs:
        for saved in ("final-bf16", "lk-bf16"):
            (job / name / saved).mkdir(parents=True)
            (job / name / saved / "model.safetensors").write_bytes(torch.randint(0, 255, (3000,), dtype=torch.uint8).numpy().tobytes())
        (job / name / "checkpoints-tv" / "checkpoint-9").mkdir(parents=True)
        (job / name / "checkpoints-tv" / "checkpoint-9" / "trainer_state.json").write_text("{}")
    (job / "new" / "chat").mkdir(parents=True)
    (job / "new" / "chat" / "gpu-magpie-train.jsonl").write_text('{"prompt": "p"}\n')
    monkeypatch.setattr(gpu_example, "PART_BYTES", 1000)
    gpu_example.package(job, gpu_example.KINDS["mtp"].runs)
    parts = sorted(job.glob("results.tgz.part-*"))
    assert len(parts) > 1 and all(part.stat().st_size <= 1000 for part in parts)
    whole = tmp_path / "whole.tgz"
    whole.write_bytes(b"".join(part.read_bytes() for part in parts))
    with tarfile.open(whole) as archive:
        names = set(archive.getnames())
    assert {"results/mtp-chat/model.safetensors", "results/mtp-chat-lk/model.safetensors",
            "results/mtp-chat-nottt/model.safetensors", "results/mtp-chat-tv-trainer_state.json",
            "results/new/chat/gpu-magpie-train.jsonl"} <= names
    assert "results/mtp-chat-nottt-lk/model.safetensors" not in names, "the ablation's LK checkpoint stays behind"
    assert (job / "DONE").exists()
