"""What a target forward costs on this hardware: ``C(batch, new_tokens, context)``.

Verification is not free even at batch 1 (on 2 CPU cores 8 new tokens cost about twice one), and
with many requests a CPU is compute-bound, so every drafted slot costs nearly what a decoded
token does: D-cut needs the real surface. ``profile_target`` measures a grid (warm-up, medians,
progress bar), ``CostModel`` interpolates it, monotone in batch and context (not in new tokens,
which a CPU's small-matrix kernels can make cheaper in more rows than in fewer), and saves it as JSON
keyed by target and hardware; loading a profile made on other hardware warns.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..modeling_angelspec_common import wait_for_device

logger = logging.getLogger(__name__)


PROFILE_FORMAT = 3  # what `profile_target` writes; `load_or_profile` re-measures older saved profiles


CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(*keys: str) -> str | None:
    """The first value of one of ``keys`` in ``/proc/cpuinfo``, or None where there is none."""
    try:
        for line in CPUINFO.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return None


@functools.cache
def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s where there is one, else `platform.processor()`.

    Why not `platform.processor()` alone: on Linux it is usually empty, so every x86-64 Linux
    machine with the same thread count had one `hardware_id`, and a profile carried to another CPU
    (a home directory shared between machines, a copied cache) loaded without the warning."""
    return _cpuinfo_field("model name", "Model", "Hardware") or platform.processor() or "unknown"


# CPU flags that change what a forward costs beyond the vector width torch dispatches on: units
# for bfloat16 products (without them oneDNN emulates bfloat16, many times slower than float32).
BFLOAT16_FLAGS = {"avx512_bf16": "bf16", "amx_bf16": "amx", "bf16": "bf16"}


@functools.cache
def cpu_isa() -> str:
    """The CPU's vector instruction set as the kernels see it, for example ``AVX512+bf16``.

    Why: cloud VMs often report a bare model name (``AMD EPYC``) for CPU generations whose kernels
    differ by more than 2x (an AVX2-only EPYC emulates bfloat16; one with avx512_bf16 does not), and
    this project's own sessions ran on both under that one name and one cache directory."""
    flags = set((_cpuinfo_field("flags", "Features") or "").split())
    units = sorted({name for flag, name in BFLOAT16_FLAGS.items() if flag in flags})
    return "+".join([torch.backends.cpu.get_cpu_capability(), *units])


def hardware_id(device: torch.device | str | None = None) -> str:
    """What a cost profile was measured on: the name of the GPU ``device`` is, or the CPU's model,
    instruction set and thread count (``device`` None: the first GPU where there is one).

    The target's device, not the machine's: a CPU target on a machine with a GPU was keyed by the
    GPU, so its profile and the GPU target's shared one file, each loaded as the other's."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.machine()}:{cpu_model()}:{cpu_isa()}:threads={torch.get_num_threads()}"


@dataclass
class CostModel:
    """Seconds of one target forward of ``batch_sizes[b]`` rows, each verifying ``tokens[i]`` new
    tokens at context ``contexts[j]``: ``seconds[b][i][j]``.

    A profile without ``batch_sizes`` (the batch-1 format) is read as batch 1 with a 2-D grid.
    """

    target: str
    hardware: str
    tokens: list[int]
    contexts: list[int]
    seconds: list  # [len(batch_sizes)][len(tokens)][len(contexts)]
    batch_sizes: list[int] | None = None
    # Profiles saved before format 2 stored a grid forced monotone in new tokens too (see below);
    # before format 3 each point's repeats were timed back to back (see `profile_target`).
    profile_format: int = 1

    def __post_init__(self):
        if self.batch_sizes is None:
            self.batch_sizes, self.seconds = [1], [self.seconds]
        grid = torch.tensor(self.seconds, dtype=torch.float64)
        expected = (len(self.batch_sizes), len(self.tokens), len(self.contexts))
        if tuple(grid.shape) != expected:
            raise ValueError(f"cost profile grid has shape {tuple(grid.shape)}, expected {expected} "
                             "(batch sizes x tokens x contexts); re-run `angelspec-hf profile`.")
        if not bool(torch.isfinite(grid).all()) or bool((grid <= 0).any()):
            raise ValueError("cost profile holds seconds that are not finite and positive; re-run `angelspec-hf profile`.")
        # Interpolation walks each axis in increasing order (and the monotone fit below relies on it).
        for axis, name in enumerate(("batch_sizes", "tokens", "contexts")):
            values = [int(v) for v in getattr(self, name)]
            if len(set(values)) < len(values) or min(values) < 0:
                raise ValueError(f"cost profile {name} must be distinct and not negative, got {values}.")
            order = sorted(range(len(values)), key=values.__getitem__)
            setattr(self, name, [values[i] for i in order])
            grid = grid.index_select(axis, torch.tensor(order))
        # More rows or context never cost less, so those axes are made monotone against noise. New
        # tokens per row are not: a CPU's GEMM kernels for a few rows can be slower than for more
        # (measured on the reference target, an AMD CPU with MKL, 2 threads, context 64: 1 token
        # 59 ms, 2 tokens 124 ms, 8 tokens 102 ms), and a monotone fit there priced 8 tokens at the
        # 2-token cost or more, which made D-cut cut drafts that paid.
        for axis in (0, 2):
            grid = torch.cummax(grid, dim=axis).values
        self.seconds = grid.tolist()

    def verify_seconds(self, new_tokens: int, context: int, batch: int = 1) -> float:
        """Linear interpolation on every axis, clamped at the grid's edges, except that batches
        beyond the largest profiled one scale linearly (a CPU is compute-bound there) and new tokens
        beyond the most profiled go on along the grid's last step (not flat: a drafter of 32
        positions would have verified 32 tokens at the price of 16)."""
        largest = self.batch_sizes[-1]
        b0, b1, tb = _interpolate_1d(self.batch_sizes, min(batch, largest))
        at = [self._batch_plane_seconds(b, new_tokens, context) for b in (b0, b1)]
        seconds = at[0] * (1 - tb) + at[1] * tb
        return seconds * batch / largest if batch > largest else seconds

    def _batch_plane_seconds(self, b: int, new_tokens: float, context: float) -> float:
        plane, most = self.seconds[b], self.tokens[-1]
        seconds = _interpolate_2d(self.tokens, self.contexts, plane, min(new_tokens, most), context)
        if new_tokens <= most or len(self.tokens) < 2:
            return seconds
        before = _interpolate_2d(self.tokens, self.contexts, plane, self.tokens[-2], context)
        step = max(0.0, (seconds - before) / (most - self.tokens[-2]))
        return seconds + step * (new_tokens - most)

    def slot_seconds(self, context: int) -> float:
        """The least one verified slot (a row's new token) costs at ``context`` anywhere on the
        profiled grid: a forward's seconds over its rows times new tokens, where that is least (the
        grid's compute-bound end). What a drafter's reading of missed positions is priced against
        (`BatchDCutPolicy.first_step_efficiency`). Read off the grid's points directly, where
        `verify_seconds` interpolates along the context alone (the same values): it is asked every
        step while a drafter waits for its first one, and through `verify_seconds` it took 81 us on
        the reference profile, 6 us so."""
        c0, c1, tc = _interpolate_1d(self.contexts, context)
        return min((plane[c0] * (1 - tc) + plane[c1] * tc) / (tokens * batch)
                   for batch, by_tokens in zip(self.batch_sizes, self.seconds)
                   for tokens, plane in zip(self.tokens, by_tokens))

    def save(self, path: str | Path) -> Path:
        """Written whole or not at all (a temporary file renamed over the path): a run stopped while
        saving, or two processes profiling at once, never leave half a profile."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(self), indent=2))
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> "CostModel":
        """A saved profile; `ValueError` naming the file where it is not one (a warning where it was
        measured on other hardware than ``device``'s, see `hardware_id`)."""
        try:
            fields = json.loads(Path(path).read_text())
            model = cls(**fields)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as error:
            raise ValueError(f"{path} is not a readable cost profile ({type(error).__name__}: {error}); delete it or "
                             "re-run `angelspec-hf profile`.") from None
        if model.hardware != hardware_id(device):
            logger.warning("Cost profile %s was measured on %s, this is %s: re-run `angelspec-hf profile`.",
                           path, model.hardware, hardware_id(device))
        return model


# File names are kept under this many characters (most file systems allow 255 bytes).
PROFILE_NAME_LIMIT = 200


def profile_path(target_name: str, device: torch.device | str | None = None) -> Path:
    """Where `load_or_profile` keeps the profile of a target on the hardware of ``device``.

    A name too long for a file (a deep local checkpoint path) is cut and ends in a hash of the whole."""
    from ..reference import cache_home

    key = f"{target_name}--{hardware_id(device)}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    if len(safe) > PROFILE_NAME_LIMIT:
        safe = f"{safe[:PROFILE_NAME_LIMIT - 17]}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    return cache_home() / "profiles" / f"{safe}.json"


# Batch sizes the engine's profile measures. Batch 2 and 8-12 are measured rather than
# interpolated: on the reference target (an AMD CPU, 2 threads, float32) a plain step of 2 rows
# costs what one of 4 does (113 ms, where interpolating between 1 and 4 said 79 ms), and 12 rows
# verifying 8 slots at context 256 cost 416 ms where interpolating between 4 and 16 said 335. Priced so, D-cut
# thought plain steps cheap at the end of a batch and drafting cheap in a full one. At concurrency 4
# (DFly-Block8, 12 prompts) it ran 8% below fixed windows in the bench of 2026-12-02; with the
# dense grid 3% and 10% above them in two interleaved runs.
ENGINE_BATCH_SIZES = (1, 2, 4, 8, 12, 16)


def load_or_profile(target, target_name: str, refresh: bool = False,
                    batch_sizes: tuple[int, ...] = ENGINE_BATCH_SIZES) -> CostModel:
    """The saved profile of this target (in its dtype, with or without exact verification kernels or
    packed linears) on this hardware, measuring it first if there is none or the saved one lacks a
    batch size asked for."""
    from .exact import is_verification_exact
    from .packed import is_packed

    target_name = f"{target_name}@{str(target.dtype).removeprefix('torch.')}"
    if is_verification_exact(target):
        target_name += "+exact"
    if is_packed(target):
        target_name += "+packed"
    path = profile_path(target_name, target.device)
    if path.exists() and not refresh:
        try:
            model = CostModel.load(path, target.device)
        except ValueError as error:
            logger.warning("%s: profiling again.", error)
        else:
            if model.target != target_name:
                # Names that differ only in characters a file name cannot hold ("org/m", "org_m") share a path.
                logger.warning("The saved profile %s is %s's, not %s's: profiling again.", path, model.target, target_name)
            elif set(batch_sizes) <= set(model.batch_sizes) and model.profile_format >= PROFILE_FORMAT:
                return model
            else:
                logger.info("The saved profile %s is in an older format (no batch axis, new tokens forced monotone, "
                            "or repeats timed back to back) or lacks batch sizes %s: profiling again.", path, batch_sizes)
    model = profile_target(target, target_name, batch_sizes=batch_sizes)
    model.save(path)
    logger.info("Saved the cost profile to %s", path)
    return model


def _interpolate_1d(xs: list[int], x: float) -> tuple[int, int, float]:
    if x <= xs[0]:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            return i, i + 1, (x - xs[i]) / (xs[i + 1] - xs[i])
    raise AssertionError("unreachable")


def _interpolate_2d(rows: list[int], columns: list[int], grid: list[list[float]], row: float, column: float) -> float:
    r0, r1, tr = _interpolate_1d(rows, row)
    c0, c1, tc = _interpolate_1d(columns, column)
    top = grid[r0][c0] * (1 - tc) + grid[r0][c1] * tc
    bottom = grid[r1][c0] * (1 - tc) + grid[r1][c1] * tc
    return top * (1 - tr) + bottom * tr


def _timed(function, repeats: int) -> list[float]:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def _prefilled_cache(target, batch: int, context: int) -> DynamicCache:
    """A cache holding ``context`` random tokens in each of ``batch`` rows, which the timed forwards
    can crop back to them."""
    cache = DynamicCache(config=target.config)
    vocab = target.config.get_text_config().vocab_size
    target(torch.randint(0, vocab, (batch, context), device=target.device), past_key_values=cache, use_cache=True)
    # Sliding-window layers past their window keep only the window and refuse to crop (transformers'
    # RuntimeError, Gemma 3 at context 768 for one) unless they record past states from here on.
    cache.activate_past_recording()
    return cache


def _verify_forward(target, cache: DynamicCache, batch: int, count: int):
    """A forward of ``count`` new tokens a row over ``cache``, which it leaves as it found it: what
    verifying a draft of ``count - 1`` costs, run to its end (`wait_for_device`)."""
    vocab = target.config.get_text_config().vocab_size
    new = torch.randint(0, vocab, (batch, count), device=target.device)

    def step():
        target(new, past_key_values=cache, use_cache=True)
        wait_for_device(target.device)
        cache.crop(-count)

    return step


@torch.no_grad()
def profile_target(target, name: str, tokens=(1, 2, 4, 8, 16), contexts=(64, 256, 768),
                   batch_sizes=ENGINE_BATCH_SIZES, repeats: int = 2, sweeps: int = 3) -> CostModel:
    """Measure the target's forward time over a grid of batch size x new tokens x context length.

    Each point is the median of ``repeats`` timings in each of ``sweeps`` passes over the whole
    grid, not of back-to-back timings: on a shared machine a slow spell lasts seconds, and when it
    fell on one point's consecutive repeats it priced that point 45% high (measured here: 8 new
    tokens at 155 ms where generate's verification forwards took 107 ms) and, made monotone in
    context, every longer context with it.
    """
    samples = [[[[] for _ in contexts] for _ in tokens] for _ in batch_sizes]
    points = len(batch_sizes) * len(tokens) * len(contexts)
    with tqdm(total=sweeps * points, desc="profiling target", unit="point") as bar:
        for _ in range(sweeps):
            for b, batch in enumerate(batch_sizes):
                for j, context in enumerate(contexts):
                    cache = _prefilled_cache(target, batch, context)
                    for i, count in enumerate(tokens):
                        samples[b][i][j] += _timed(_verify_forward(target, cache, batch, count), repeats)
                        bar.update(1)
    grid = [[[statistics.median(point) for point in row] for row in table] for table in samples]
    return CostModel(target=name, hardware=hardware_id(target.device), tokens=list(tokens), contexts=list(contexts), seconds=grid,
                     batch_sizes=list(batch_sizes), profile_format=PROFILE_FORMAT)


@torch.no_grad()
def interleaved_verify_seconds(targets: dict, new_tokens: int = 9, context: int = 256,
                               rounds: int = 12) -> dict[str, list[float]]:
    """Batch-1 forwards of ``new_tokens`` at ``context`` timed in turn on each of ``targets``
    (name -> model), the order reversed every round; ``rounds`` timings per name.

    For comparing targets (one model in two dtypes), not for pricing: timed one after the other, two
    profiles of the same target a minute apart compared a slow spell on the host, not the dtypes
    (float32 verification at 130 ms against 78.5 in bfloat16, session 48, where a quiet hour read
    67.8 against 67.3). Turn by turn, a spell lands on both.
    """
    steps = {}
    for name, target in targets.items():
        steps[name] = _verify_forward(target, _prefilled_cache(target, 1, context), 1, new_tokens)
        steps[name]()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in targets}
    for round_ in range(rounds):
        for name in (list(steps) if round_ % 2 == 0 else list(reversed(steps))):
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds
