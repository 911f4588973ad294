"""Hub features, offline: a fake of the API object records what would be sent; pulling reads a
populated cache in the Hub's layout with HF_HUB_OFFLINE=1."""

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import yaml

from angelspec_hf import DFlyDrafter, MTPDrafter
from angelspec_hf.errors import DrafterConfigError
from angelspec_hf.hub import GENERATED_MARKER, find_drafters, model_card, write_model_card


class FakeHubApi:
    """Records create_repo/create_commit calls and the files they carry; lists canned models."""

    def __init__(self, models=()):
        self.calls, self.files, self.models = [], {}, list(models)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://hub.invalid/{repo_id}"

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, kwargs))
        for op in operations:
            with open(op.path_or_fileobj, "rb") as handle:
                self.files[op.path_in_repo] = handle.read()
        return SimpleNamespace(commit_url=f"https://hub.invalid/{repo_id}/commit/1")

    def create_branch(self, repo_id, branch, **kwargs):
        self.calls.append(("create_branch", repo_id, {"branch": branch, **kwargs}))

    def list_models(self, filter=None, limit=None, cardData=False):
        self.calls.append(("list_models", filter, {"cardData": cardData}))
        return iter(self.models)


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


def test_model_card_has_base_model_tags_and_results(targets):
    drafter = DFlyDrafter.from_target(targets.target("llama"), conditioning="global", hidden_correction=False)
    card = model_card(drafter.config, {"code": {"tau": 2.5, "speedup": 1.7, "prompts": 20, "lossless": True}},
                      {"name": "dflash-code"}, "org/tiny-DFlash")
    meta = front_matter(card)
    assert meta["base_model"] == "tiny-llama-seed0" and meta["library_name"] == "transformers"
    assert meta["tags"] == ["speculative-decoding", "angelspec", "dfly", "dflash"]
    assert meta["angelspec_results"]["code"]["tau"] == 2.5
    assert "| code | 20 | 2.50 | 1.70x | yes |" in card and '"name": "dflash-code"' in card
    assert "trust_remote_code=True" in card and GENERATED_MARKER in card
    bf16 = model_card(drafter.config, {"code": {"tau": 2.5, "dtype": "bfloat16", "exact_verification": True,
                                                    "max_new_tokens": 128, "threads": 1}})
    assert "target in bfloat16 with `angelspec_hf.generation.exact.make_verification_exact`, 128 new tokens, 1 torch thread." in bf16
    assert front_matter(model_card(drafter.config, {"code": {"tau": 2.5, "note": "yes: no"}}))["angelspec_results"]["code"]["note"] == "yes: no"


def test_push_uploads_weights_config_code_and_card(targets):
    api = FakeHubApi()
    drafter = MTPDrafter.from_target(targets.target("llama"))
    info = drafter.push_to_hub("org/tiny-mtp", private=True, create_pr=True, api=api)
    assert info.commit_url.endswith("/commit/1")
    assert [call[0] for call in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0][2]["private"] is True and api.calls[1][2]["create_pr"] is True
    assert {"config.json", "model.safetensors", "modeling_angelspec_mtp.py", "modeling_angelspec_common.py",
            "configuration_angelspec_mtp.py", "errors.py", "README.md"} <= set(api.files)
    meta = front_matter(api.files["README.md"].decode())
    assert meta["tags"] == ["speculative-decoding", "angelspec", "mtp"]


def test_push_takes_push_to_hubs_keywords(targets, tmp_path):
    """revision, commit_description and tags reach the upload (revision was dropped: the drafter went to
    main); an unknown keyword is a TypeError, not silently ignored; a foreign-format export is refused
    by name (it crashed writing the card)."""
    api = FakeHubApi()
    drafter = MTPDrafter.from_target(targets.target("llama"))
    drafter.push_to_hub("org/tiny-mtp", api=api, revision="v2", commit_description="why", tags=["chat", "mtp"])
    assert [call[0] for call in api.calls] == ["create_repo", "create_branch", "create_commit"]
    assert api.calls[1][2]["branch"] == "v2"
    assert api.calls[2][2]["revision"] == "v2" and api.calls[2][2]["commit_description"] == "why"
    assert front_matter(api.files["README.md"].decode())["tags"] == ["speculative-decoding", "angelspec", "mtp", "chat"]
    with pytest.raises(TypeError, match="revison"):
        drafter.push_to_hub("org/tiny-mtp", api=api, revison="v2")
    from angelspec_hf.hub import push_drafter
    from angelspec_hf.interop import export_eagle3
    from angelspec_hf.reference import tiny_target

    export_eagle3(MTPDrafter.from_target(tiny_target("llama", num_hidden_layers=8), draft_vocab_size=48), tmp_path / "eagle3")
    with pytest.raises(DrafterConfigError, match=r"holds a '\w+' model, not an angelspec-hf drafter.*convert --to angelspec-hf"):
        push_drafter(tmp_path / "eagle3", "org/theirs", api=api)


def test_push_to_hub_shards_as_max_shard_size_asks(targets):
    """max_shard_size is one of push_to_hub's keywords; it was dropped with the rest."""
    api = FakeHubApi()
    DFlyDrafter.from_target(targets.target("llama")).push_to_hub("org/tiny-dfly", api=api, max_shard_size="40KB")
    shards = [name for name in api.files if name.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in api.files


def test_a_user_written_card_is_kept(targets, tmp_path):
    drafter = DFlyDrafter.from_target(targets.target("llama"))
    drafter.save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text("# My own card\n")
    assert not write_model_card(tmp_path)
    api = FakeHubApi()
    from angelspec_hf.hub import push_drafter

    push_drafter(tmp_path, "org/mine", api=api)
    assert api.files["README.md"] == b"# My own card\n"
    # A generated card is refreshed, e.g. with measured numbers.
    (tmp_path / "README.md").unlink()
    assert write_model_card(tmp_path, results={"math": {"tau": 1.9}})
    assert front_matter((tmp_path / "README.md").read_text())["angelspec_results"]["math"]["tau"] == 1.9


def test_push_of_a_directory_that_is_not_a_drafter(tmp_path):
    from angelspec_hf.hub import push_drafter

    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        push_drafter(tmp_path, "org/nothing", api=FakeHubApi())


def test_find_drafters_ranks_by_reported_tau():
    def model(repo, base, tau=None):
        card = {"base_model": base, "tags": ["speculative-decoding"]}
        if tau is not None:
            card["angelspec_results"] = {"code": {"tau": tau}, "math": {"tau": tau - 0.5}}
        return SimpleNamespace(id=repo, tags=["speculative-decoding"], card_data=card)

    api = FakeHubApi([model("a/slow", "T", 1.4), model("b/unknown", "T"), model("c/fast", "T", 2.9),
                      model("d/other-target", "U", 9.0)])
    found = find_drafters("T", api=api)
    assert [entry["repo_id"] for entry in found] == ["c/fast", "a/slow", "b/unknown"]
    assert found[0]["best_tau"] == 2.9 and found[2]["best_tau"] is None
    assert api.calls[0][1] == ["base_model:T", "speculative-decoding"]


PULL = textwrap.dedent(
    """
    import json, sys
    import angelspec_hf
    from transformers import AutoModel
    from angelspec_hf import DFlyDrafter
    repo, revision = sys.argv[1], sys.argv[2]
    drafter = AutoModel.from_pretrained(repo, revision=revision)
    direct = DFlyDrafter.from_pretrained(repo, revision=revision)
    print(json.dumps({"type": type(drafter).__name__, "block_size": drafter.config.block_size,
                      "direct": type(direct).__name__}))
    """
)


def test_pull_from_a_populated_hub_cache_offline(targets, tmp_path):
    """The Hub cache layout (models--org--name/{refs,snapshots}) read with HF_HUB_OFFLINE=1."""
    drafter = DFlyDrafter.from_target(targets.target("llama"), block_size=5)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--org--tiny-dfly"
    drafter.save_pretrained(repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    for revision in ("main", commit):
        result = subprocess.run([sys.executable, "-c", PULL, "org/tiny-dfly", revision], capture_output=True,
                                text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report == {"type": "DFlyDrafter", "block_size": 5, "direct": "DFlyDrafter"}


def test_evaluation_writes_measured_numbers_into_the_card(targets, tmp_path):
    from angelspec_hf.cli import evaluate_into_card
    from fitting import tiny_tokenizer

    targets.fitted("llama", "dfly-hybrid-corr").save_pretrained(tmp_path)
    results = evaluate_into_card(targets.target("llama"), tiny_tokenizer(), tmp_path, ["math"], 2, 12)
    stored = json.loads((tmp_path / "angelspec_results.json").read_text())
    assert stored["math"]["prompts"] == 2 and stored["math"]["lossless"] is True
    assert stored["math"]["tau"] == round(results["math"].tau, 3) >= 1.0
    assert stored["math"]["dtype"] == "float32" and stored["math"]["max_new_tokens"] == 12
    assert stored["math"]["exact_verification"] is False
    card = (tmp_path / "README.md").read_text()
    meta = front_matter(card)
    assert meta["angelspec_results"]["math"]["tau"] == stored["math"]["tau"]
    assert meta["angelspec_results"]["math"]["dtype"] == "float32"
    assert f"target in float32, 12 new tokens, {stored['math']['threads']} torch thread" in card


def test_eval_command_measures_the_held_out_rows_of_a_prompt_file(targets, tmp_path, monkeypatch):
    """`eval --prompts FILE` measures the rows `rollouts --prompts FILE` leaves out of training
    (every fourth, from the first), reported under the file's name; a bad file is refused by name
    before anything loads."""
    from angelspec_hf import cli
    from angelspec_hf.prompts import load_prompts
    from fitting import tiny_tokenizer

    target = targets.target("llama")
    monkeypatch.setattr(cli, "load_target", lambda name, dtype="float32": (target, tiny_tokenizer()))
    targets.fitted("llama", "dfly-hybrid-corr").save_pretrained(tmp_path / "drafter")
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"prompt": f"w{6 + i} w{40 + i} w{70 + i}"}) + "\n" for i in range(9)))
    report = tmp_path / "eval.json"
    args = ["eval", "--drafter", str(tmp_path / "drafter"), "--target", "tiny", "--prompts", str(mine),
            "--max-new-tokens", "8", "--report", str(report)]
    assert cli.main(args) == 0
    measured = json.loads(report.read_text())["domains"]
    assert list(measured) == ["mine"] and measured["mine"]["prompts"] == 3  # rows 1, 5 and 9
    assert set(load_prompts(str(mine), "eval")) == {"w6 w40 w70", "w10 w44 w74", "w14 w48 w78"}
    assert not set(load_prompts(str(mine), "eval")) & set(load_prompts(str(mine), "train"))
    assert cli.main([*args, "--per-set", "1"]) == 0
    assert json.loads(report.read_text())["domains"]["mine"]["prompts"] == 1
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit, match="--prompts: .*bad.jsonl, line 1"):
        cli.main([*args[:6], str(tmp_path / "bad.jsonl")])
