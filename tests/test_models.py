"""Drafter configs and models: derivation from the target, switches, save/load round trips."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModel

from angelspec_hf import DFlyDrafter, DFlyDrafterConfig, MTPDrafter, MTPDrafterConfig, embedding_fingerprint
from angelspec_hf.errors import DrafterConfigError
from angelspec_hf.modeling_angelspec_common import FINGERPRINT_MIN_COSINE, fingerprint_similarity
from conftest import DRAFTER_KINDS, PROMPT_LENGTH, build_drafter, tiny_target


def test_from_target_derives_sizes_layers_and_fingerprint(targets):
    target = targets.target("qwen3")
    drafter = DFlyDrafter.from_target(target, block_size=8)
    config = drafter.config
    text = target.config
    assert (config.vocab_size, config.hidden_size, config.num_target_layers) == (text.vocab_size, text.hidden_size, 6)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.target_layer_ids == [1, 2, 3]  # evenly spaced from 1 to L-3
    assert config.target_name_or_path == "tiny-qwen3-seed1" and config.target_model_type == "qwen3"
    assert config.target_embedding_fingerprint == embedding_fingerprint(target.get_input_embeddings().weight)
    assert config.mask_token_id == text.vocab_size - 1  # no usable unk token in the tiny config
    assert drafter.max_draft_tokens == 7
    mtp = MTPDrafter.from_target(target, num_draft_tokens=3)
    assert mtp.config.target_layer_ids == [1, 2] and mtp.config.ttt_steps == 3 and mtp.max_draft_tokens == 3


def test_dfly_default_layers_on_a_30_layer_target():
    assert DFlyDrafterConfig.default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert MTPDrafterConfig.default_target_layer_ids(30) == [1, 14, 26]


def test_fingerprint_survives_bf16_but_not_another_model(targets):
    weight = targets.target("llama").get_input_embeddings().weight
    other = targets.target("qwen3").get_input_embeddings().weight
    assert fingerprint_similarity(embedding_fingerprint(weight), embedding_fingerprint(weight.bfloat16())) > 0.999
    assert fingerprint_similarity(embedding_fingerprint(weight), embedding_fingerprint(other)) < FINGERPRINT_MIN_COSINE


@pytest.mark.parametrize(
    "conditioning, correction, variant, params",
    [
        ("global", False, "dflash", {"context_proj.weight"}),
        ("layerwise", False, "dflare", {"layer_fusion_weights"}),
        ("hybrid", True, "dfly", {"context_proj.weight", "layer_fusion_weights", "hidden_correction.mlp.down_proj.weight"}),
    ],
)
def test_dfly_switches_select_the_published_variants(targets, conditioning, correction, variant, params):
    drafter = DFlyDrafter.from_target(targets.target("llama"), conditioning=conditioning, hidden_correction=correction)
    names = {name for name, _ in drafter.named_parameters()}
    assert drafter.config.variant == variant
    assert params <= names
    missing = {"context_proj.weight", "layer_fusion_weights", "hidden_correction.mlp.down_proj.weight"} - params
    assert not missing & names


def test_untrained_correction_head_equals_dflash(targets):
    """The correction head's output projection starts at zero, so DFly starts exactly as DFlash."""
    target = targets.target("llama")
    torch.manual_seed(0)
    with_head = DFlyDrafter.from_target(target, conditioning="global", hidden_correction=True).eval()
    without = DFlyDrafter.from_target(target, conditioning="global", hidden_correction=False).eval()
    without.load_state_dict({k: v for k, v in with_head.state_dict().items() if not k.startswith("hidden_correction")})
    assert torch.count_nonzero(with_head.hidden_correction.mlp.down_proj.weight) == 0
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    target.generate(prompt, assistant_model=with_head, max_new_tokens=12, do_sample=False, eos_token_id=None)
    first = with_head.last_speculation_stats.as_dict()
    target.generate(prompt, assistant_model=without, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert without.last_speculation_stats.as_dict() == first


@pytest.mark.parametrize("embed_norm", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_drafting_corrects_as_the_trained_correction_head_does(targets, embed_norm, rows):
    """Drafting's split, fused correction (`CorrectionSteps`) is the head's own function."""
    from angelspec_hf.modeling_angelspec_dfly import CorrectionSteps

    torch.manual_seed(3)
    drafter = DFlyDrafter.from_target(targets.target("llama"), block_size=6, correction_embed_norm=embed_norm).eval()
    head = drafter.hidden_correction
    with torch.no_grad():
        head.mlp.down_proj.weight.normal_(std=0.2)  # trained-like: the untrained head adds nothing
        if embed_norm:
            head.embed_norm.weight.uniform_(0.5, 1.5)
        z, previous = torch.randn(rows, 5, drafter.config.hidden_size), torch.randn(rows, drafter.config.hidden_size)
        steps = CorrectionSteps(head)
        prepared = steps.prepare(z)
        for index in range(5):
            torch.testing.assert_close(steps.step(z[:, index], prepared[:, index], previous),
                                       head(z[:, index], previous), rtol=1e-5, atol=1e-5)


def _close_to_linear(got, x, weight, bias=None):
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if x.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, exact, **tolerance)


def _packing_kernels(dtype):
    from angelspec_hf import modeling_angelspec_common as common

    return ["packed"] if dtype in common.packing_dtypes() else []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["linear", "mv", "mv-float32", "packed"])
def test_row_products_compute_linear_whichever_kernel_is_picked(monkeypatch, dtype, kernel):
    """Every kernel `fastest_row_kernel` may pick gives ``F.linear`` (in the input's dtype), the pick
    is timed once per shape and dtype, and several rows give ``F.linear`` too (packed where it serves)."""
    from angelspec_hf import modeling_angelspec_common as common

    if kernel == "packed" and not _packing_kernels(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    torch.manual_seed(4)
    weight, row, rows = torch.randn(96, 40, dtype=dtype), torch.randn(1, 40, dtype=dtype), torch.randn(3, 40, dtype=dtype)
    monkeypatch.setattr(common, "_ROW_KERNELS", {(tuple(weight.shape), dtype): kernel})
    product = common.RowLinear(weight)
    with torch.no_grad():
        _close_to_linear(product(rows), rows, weight)
        assert product.kernel is None, "only a one-row call picks a kernel"
        _close_to_linear(product(row), row, weight)
        assert product.kernel == kernel
        _close_to_linear(product(rows), rows, weight)
        monkeypatch.setattr(common, "_ROW_KERNELS", {})
        picked = common.fastest_row_kernel(weight)
    allowed = {"linear", "mv"} | ({"mv-float32"} if dtype == torch.bfloat16 else set()) | set(_packing_kernels(dtype))
    assert picked in allowed
    assert common._ROW_KERNELS == {(tuple(weight.shape), dtype): picked}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_linear_packs_at_inference_and_trains_like_nn_linear(monkeypatch, dtype):
    """Drafter layers multiply through a packed weight at inference on a CPU (where oneDNN packs the
    dtype), repack a weight that changed, keep ``nn.Linear``'s state dict and gradients, and fall
    back to ``F.linear`` where packing disagrees with it."""
    from angelspec_hf import modeling_angelspec_common as common

    if not _packing_kernels(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    torch.manual_seed(5)
    layer = common.DraftLinear(40, 24, bias=True).to(dtype)
    plain = torch.nn.Linear(40, 24, bias=True).to(dtype)
    plain.load_state_dict(layer.state_dict())
    assert list(layer.state_dict()) == ["weight", "bias"]
    block, row = torch.randn(2, 8, 40, dtype=dtype), torch.randn(1, 40, dtype=dtype)
    with torch.no_grad():
        _close_to_linear(layer(block), block, layer.weight, layer.bias)
        assert layer in common._PACKED_WEIGHTS, "a block of rows goes through the packed weight"
        one_row = layer(row)
        _close_to_linear(one_row, row, layer.weight, layer.bias)
        if dtype == torch.float32:
            assert torch.equal(one_row, F.linear(row, layer.weight, layer.bias)), "one float32 row keeps the BLAS"
        layer.weight.mul_(2)
        _close_to_linear(layer(block), block, layer.weight, layer.bias)
    # Training: a gradient wanted, so F.linear, bit for bit, with gradients.
    x = torch.randn(3, 40, dtype=dtype, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.float().sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    # A machine where the packed product disagrees: the stock kernel, and a warning naming the shape.
    monkeypatch.setattr(common, "_PACKING_AGREES", {})
    monkeypatch.setattr(common, "packing_error", lambda *args, **kwargs: 1.0)
    fresh = common.DraftLinear(40, 24, bias=True).to(dtype)
    asked = []
    agrees = common.packing_agrees
    monkeypatch.setattr(common, "packing_agrees", lambda *args: asked.append(1) or agrees(*args))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(fresh(block), F.linear(block, fresh.weight, fresh.bias))
    assert common.packed_weight(fresh, fresh.weight, fresh.bias) is None
    assert len(asked) == 1, "the refusal is kept with the weight: not packed again on every product"


def test_reduced_vocabulary_maps_draft_ids_to_target_ids(targets):
    target = targets.target("llama")
    ids = torch.tensor([40, 3, 17, 90, 5])
    drafter = MTPDrafter.from_target(target, draft_token_ids=ids)
    expected = ids.sort().values
    assert drafter.config.draft_vocab_size == 5 and drafter.config.uses_reduced_vocab
    assert torch.equal(drafter.draft_token_ids(), expected)
    assert torch.equal(drafter.t2d.nonzero().flatten(), expected)
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight[expected])
    logits = drafter.logits(torch.randn(1, 2, drafter.config.hidden_size), target.lm_head)
    assert logits.shape == (1, 2, target.config.vocab_size)
    finite = torch.isfinite(logits[0, 0]).nonzero().flatten()
    assert torch.equal(finite, expected)


def test_dfly_reduced_vocabulary_drafts_only_its_tokens(targets):
    target = targets.target("llama")
    ids = torch.tensor([40, 3, 17, 90, 5])
    drafter = DFlyDrafter.from_target(target, block_size=4, draft_token_ids=ids)
    expected = ids.sort().values
    assert drafter.config.draft_vocab_size == 5 and torch.equal(drafter.draft_token_ids(), expected)
    z = torch.randn(1, 3, drafter.config.hidden_size)
    full = drafter.logits(z, target.lm_head)
    reduced = drafter.logits(z, drafter.draft_head(target.lm_head))
    assert reduced.shape == full.shape
    assert torch.equal(torch.isfinite(reduced[0, 0]).nonzero().flatten(), expected)
    torch.testing.assert_close(reduced[..., expected], full[..., expected])
    # The full vocabulary again, and ids that cannot be target tokens.
    drafter.set_draft_vocab(torch.arange(target.config.vocab_size))
    assert drafter.config.draft_vocab_size is None and "draft_vocab" not in drafter.state_dict()
    with pytest.raises(DrafterConfigError, match="draft_token_ids"):
        drafter.set_draft_vocab([target.config.vocab_size])


def test_dfly_reduced_head_is_gathered_again_only_when_its_sources_change():
    """Every generator asks for the draft head; it is kept while the target's head weight, the draft
    vocabulary and the dtype stay, and gathered afresh (with the new rows) when any changes."""
    target = tiny_target("llama", seed=5)  # its own: the head is changed in place below
    drafter = DFlyDrafter.from_target(target, block_size=4, draft_token_ids=torch.tensor([40, 3, 17, 90, 5]))
    head = drafter.draft_head(target.lm_head)
    assert drafter.draft_head(target.lm_head) is head
    assert drafter.draft_head(target.lm_head, dtype=torch.bfloat16) is not head
    head = drafter.draft_head(target.lm_head)
    with torch.no_grad():
        target.lm_head.weight[3] += 1.0  # in place: the same tensor, a new version
    changed = drafter.draft_head(target.lm_head)
    assert changed is not head and torch.equal(changed.weight[0], target.lm_head.weight[3])
    drafter.set_draft_vocab(torch.tensor([7, 8]))
    narrowed = drafter.draft_head(target.lm_head)
    assert narrowed is not changed and torch.equal(narrowed.weight, target.lm_head.weight[[7, 8]])
    # Another drafter over the same target and vocabulary gathers its own.
    other = DFlyDrafter.from_target(target, block_size=4, draft_token_ids=torch.tensor([7, 8]))
    assert other.draft_head(target.lm_head) is not narrowed
    # A `.data` swap keeps the weight object and its version: its new memory still tells.
    target.lm_head.weight.data = torch.randn_like(target.lm_head.weight)
    swapped = drafter.draft_head(target.lm_head)
    assert swapped is not narrowed and torch.equal(swapped.weight, target.lm_head.weight[[7, 8]])
    # A head with a bias: its rows are gathered too, so a bias added or changed gathers afresh.
    target.lm_head.bias = torch.nn.Parameter(torch.zeros(target.lm_head.out_features))
    biased = drafter.draft_head(target.lm_head)
    assert biased is not swapped and torch.equal(biased.bias, torch.zeros(2))
    with torch.no_grad():
        target.lm_head.bias[8] = 3.0
    moved = drafter.draft_head(target.lm_head)
    assert moved is not biased and torch.equal(moved.bias, torch.tensor([0.0, 3.0]))


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_save_and_auto_load_round_trip(targets, tmp_path, kind):
    target = targets.target("llama")
    drafter = targets.fitted("llama", kind)
    drafter.save_pretrained(tmp_path)
    files = {path.name for path in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in files), "safetensors only"
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        keys = set(handle.keys())
    assert not any("embed_tokens" in key or key.startswith("lm_head") and not kind.endswith("reduced") for key in keys), keys
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModel"].endswith(("MTPDrafter", "DFlyDrafter"))

    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(drafter)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), type(drafter.config))
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    first = target.generate(prompt, assistant_model=drafter, max_new_tokens=15, do_sample=False, eos_token_id=None)
    stats = drafter.last_speculation_stats.as_dict()
    second = target.generate(prompt, assistant_model=loaded, max_new_tokens=15, do_sample=False, eos_token_id=None)
    assert torch.equal(first, second) and loaded.last_speculation_stats.as_dict() == stats


def test_bf16_save_keeps_dtype(targets, tmp_path):
    drafter = build_drafter("dfly-hybrid-corr", targets.target("llama")).to(torch.bfloat16)
    drafter.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        assert all(handle.get_tensor(key).dtype == torch.bfloat16 for key in handle.keys())
    assert DFlyDrafter.from_pretrained(tmp_path, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: DFlyDrafterConfig(conditioning="sideways"), "conditioning must be one of"),
        (lambda: DFlyDrafterConfig(block_size=1), "block_size"),
        (lambda: DFlyDrafterConfig(num_target_layers=6, target_layer_ids=[1, 9]), "outside the target's decoder layers"),
        (lambda: DFlyDrafterConfig(vocab_size=10, mask_token_id=10), "mask_token_id"),
        (lambda: MTPDrafterConfig(num_draft_tokens=0), "num_draft_tokens"),
        (lambda: MTPDrafterConfig(vocab_size=100, draft_vocab_size=101), "draft_vocab_size"),
        (lambda: MTPDrafterConfig(num_attention_heads=9, num_key_value_heads=2), "multiple of num_key_value_heads"),
        (lambda: MTPDrafterConfig(layer_style="deepseek", num_hidden_layers=2), "deepseek-style MTP drafter is one"),
        (lambda: MTPDrafterConfig(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
        (lambda: DFlyDrafterConfig(hidden_correction="no"), "hidden_correction must be true or false"),
        (lambda: MTPDrafterConfig(vocab_size=True), "vocab_size must be a positive integer"),
        (lambda: DFlyDrafterConfig(hidden_size=64, target_embedding_fingerprint=[0.1] * 64), "has 64 values, not the 128"),
    ],
)
def test_bad_config_arguments_raise_typed_errors(factory, message):
    with pytest.raises(DrafterConfigError, match=message):
        factory()


def test_bad_from_target_overrides(targets):
    with pytest.raises(DrafterConfigError, match="disagrees"):
        MTPDrafter.from_target(targets.target("llama"), draft_vocab_size=3, draft_token_ids=[1, 2])
    with pytest.raises(DrafterConfigError, match="block_size"):
        DFlyDrafter.from_target(targets.target("llama"), block_size=0)


@pytest.mark.parametrize("kind", ["mtp", "mtp-deepseek", "mtp-2layer"])
def test_mtp_forward_kept_at_some_positions_is_the_full_forward_there(targets, kind):
    """Ingesting asks the stack for every position's keys but each row's last output only
    (``keep``): the same keys and values, and the full forward's output at the kept positions,
    over a cache and a padded, masked batch."""
    torch.manual_seed(5)
    drafter = build_drafter(kind, targets.target("llama")).eval()
    size, rows, past_len, width = drafter.config.hidden_size, 3, 4, 6
    attention = drafter.self_attn
    past = tuple(torch.randn(rows, attention.num_kv_heads, past_len, attention.head_dim)
                 for _ in range(2 * drafter.config.num_hidden_layers))
    hidden, embeds = torch.randn(rows, width, size), torch.randn(rows, width, size)
    positions = past_len + torch.arange(width)[None].expand(rows, -1)
    mask = torch.ones(rows, 1, width, past_len + width, dtype=torch.bool).tril(diagonal=past_len)
    mask[1, :, :, 1] = False  # a padded context key
    keep = torch.tensor([5, 2, 0])
    with torch.no_grad():
        full, full_present = drafter(hidden, embeds, positions, past, mask)
        kept, kept_present = drafter(hidden, embeds, positions, past, mask, keep=keep)
    assert kept.shape == (rows, 1, size)
    torch.testing.assert_close(kept[:, 0], full[torch.arange(rows), keep], rtol=1e-5, atol=1e-5)
    for a, b in zip(kept_present, full_present, strict=True):
        assert torch.equal(a, b)
