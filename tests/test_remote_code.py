"""A saved drafter must work in a process that never imports angelspec_hf (Hub remote code)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import PROMPT_LENGTH

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    target_dir, drafter_dir, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).eval()
    prompt = torch.tensor([prompt])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    fast = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None)
    print(json.dumps({
        "identical": torch.equal(plain, fast),
        "accepted": sum(drafter.last_speculation_stats.accepted),
        "class_module": type(drafter).__module__,
        "imported_angelspec_hf": any(name.split(".")[0] == "angelspec_hf" for name in sys.modules),
    }))
    """
)


@pytest.mark.parametrize("kind", ["mtp-reduced", "dfly-hybrid-corr"])
def test_remote_code_load_and_generate_in_a_fresh_process(targets, tmp_path, kind):
    target = targets.target("llama")
    target.save_pretrained(tmp_path / "target")
    targets.fitted("llama", kind).save_pretrained(tmp_path / "drafter")
    shipped = {path.name for path in (tmp_path / "drafter").iterdir()}
    assert {"modeling_angelspec_common.py", "configuration_angelspec_common.py", "errors.py"} <= shipped

    prompt = targets.sequences("llama")[0, :PROMPT_LENGTH].tolist()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    # Run from a directory where `import angelspec_hf` could only come from site-packages, then
    # make sure the child never imported it: the remote code alone must carry the integration.
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "target"), str(tmp_path / "drafter"), json.dumps(prompt)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["identical"]
    assert report["accepted"] > 0, "the remote-code drafter must actually be used by generate"
    assert report["class_module"].startswith("transformers_modules")
    assert not report["imported_angelspec_hf"]


TWO_COPIES = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    target_dir, drafter_dir = sys.argv[1], sys.argv[2]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt = torch.tensor([[5, 9, 11, 4, 7, 3, 8, 21, 40, 12]])

    def alternatives(drafter):
        made = []
        original = drafter.get_candidate_generator
        drafter.get_candidate_generator = lambda *a, **k: made.append(original(*a, **k)) or made[-1]
        target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False, eos_token_id=None)
        return made[-1].alternatives

    remote = alternatives(AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).eval())
    import angelspec_hf  # the package's copy of the module, after the remote code installed the integration
    package = alternatives(AutoModel.from_pretrained(drafter_dir).eval())
    print(json.dumps({"remote": remote, "package": package}))
    """
)


def test_package_drafters_keep_their_alternatives_beside_remote_code_loaded_first(tmp_path):
    """The generate integration is installed by the first copy of the module a process loads; it knew
    generators by its own class, so the package's drafters lost their first-token alternatives (same
    text, fewer tokens a target forward) once a drafter had been loaded as remote code."""
    from angelspec_hf import MTPDrafter
    from angelspec_hf.reference import tiny_target

    target = tiny_target("llama", num_hidden_layers=8, seed=0)
    target.save_pretrained(tmp_path / "target")
    MTPDrafter.from_target(target).save_pretrained(tmp_path / "drafter")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", TWO_COPIES, str(tmp_path / "target"), str(tmp_path / "drafter")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"remote": 2, "package": 2}


def test_alternatives_are_verified_by_the_generators_own_copy(monkeypatch):
    """The integration is the first-loaded copy's; it hooked the target with its own AlternativesVerification,
    which reads the generator's fields and may be another version's (remote code beside the package)."""
    import torch

    from angelspec_hf import MTPDrafter
    from angelspec_hf.modeling_angelspec_common import AlternativesVerification, AngelSpecCandidateGenerator
    from angelspec_hf.reference import tiny_target

    asked = []

    def verify_alternatives(generator, target):
        asked.append(generator)
        return AlternativesVerification(generator, target)

    monkeypatch.setattr(AngelSpecCandidateGenerator, "verify_alternatives", verify_alternatives, raising=False)
    target = tiny_target("llama", num_hidden_layers=8, seed=0)
    drafter = MTPDrafter.from_target(target).eval()
    prompt = torch.tensor([[5, 9, 11, 4, 7, 3, 8, 21, 40, 12]])
    target.generate(prompt, assistant_model=drafter, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert len(asked) == 1 and asked[0].alternatives == 2
