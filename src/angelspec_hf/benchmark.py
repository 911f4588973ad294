"""The speedup benchmark at batch 1 through ``target.generate``: the main job.

For every prompt all methods run back to back (interleaved, so drifts of a shared machine hit
them alike), greedy, and each method's output is compared with plain autoregressive generate.
Per method and domain: median tokens/s, median speedup over AR on the same prompts, tau (tokens
per target forward, for drafters), and whether every output was identical.

With a temperature above 0 every method samples instead (each from the same seed on a prompt,
with transformers' default top-k), and so does every engine request. Sampled outputs cannot be
compared token for token: speculative sampling preserves the target's distribution, not its random
draws, so those rows report losslessness as not checked here (None; the distribution is what
`tests/test_sampling.py` checks) and speed only.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .evaluation import chat_inputs
from .prompts import domain_label, domain_prompts, domain_sets

logger = logging.getLogger(__name__)

AR = "AR (plain generate)"
PROMPT_LOOKUP = "prompt lookup"


@dataclass
class Method:
    name: str
    generate_kwargs: dict = field(default_factory=dict)
    drafter: object = None
    policy: object = None  # installed as drafter.draft_policy for this method's runs only
    count_forwards: bool = False  # tau from counted target forwards (assistants without our stats)
    target: object = None  # another target (None: the benchmark's); its first method is its own reference
    threads: int | None = None  # torch threads for this method's runs (None: as set)


@dataclass
class Run:
    method: str
    domain: str
    prompt_index: int
    new_tokens: int
    seconds: float
    identical: bool | None  # None: sampled, so not comparable token for token
    tau: float | None
    plain: bool = False  # plain decoding (AR or a baseline): the fastest of these is what speedups are against

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def methods_for(drafters: dict[str, object], cost_model=None, prompt_lookup_tokens: int = 8,
                target_dtype: torch.dtype | None = None) -> list[Method]:
    """AR, prompt lookup, each drafter at its fixed length and, given a cost model, with D-cut;
    a DFlash drafter also through transformers' own DFlash path, in ``target_dtype``."""
    from .generation import DCutPolicy

    methods = [Method(AR), Method(PROMPT_LOOKUP, {"prompt_lookup_num_tokens": prompt_lookup_tokens})]
    for name, drafter in drafters.items():
        methods.append(Method(name, {"assistant_model": drafter}, drafter))
        if getattr(drafter.config, "variant", None) == "dflash":
            native = {"assistant_model": transformers_dflash_assistant(drafter, target_dtype),
                      "speculation_type": "dflash"}
            methods.append(Method(f"{name} via transformers' DFlash", native, count_forwards=True))
        if cost_model is not None:
            methods.append(Method(f"{name} + D-cut", {"assistant_model": drafter}, drafter, DCutPolicy(cost_model)))
    return methods


def transformers_dflash_assistant(drafter, dtype: torch.dtype | None = None):
    """The same DFlash-mode drafter as transformers' own assistant class (``speculation_type="dflash"``),
    in ``dtype`` (default: the drafter's). Give the target's: that path feeds the target's states to
    the assistant as they are, so a bfloat16 assistant beside a float32 target fails in its first matmul."""
    import tempfile

    from transformers import AutoModel

    from .interop import export_transformers_dflash

    with tempfile.TemporaryDirectory() as directory:
        export_transformers_dflash(drafter, directory)
        return AutoModel.from_pretrained(directory, dtype=dtype or drafter.dtype).eval()


# transformers' default top-k when sampling, made explicit so that the engine (whose requests
# have no default) samples from the same distribution as batch-1 ``generate``.
SAMPLING_TOP_K = 50


def decoding_kwargs(temperature: float) -> dict:
    """Decoding settings of a benchmark run, for ``generate`` and the engine's ``submit`` alike:
    greedy at temperature 0, else sampling at it with `SAMPLING_TOP_K`."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": SAMPLING_TOP_K}


def all_lossless(checks) -> bool | None:
    """Every check passed (True), one failed (False), or some were not checked (None: sampled)."""
    checks = list(checks)
    return None if any(check is None for check in checks) else all(checks)


def benchmark_prompts(domains: list[str], per_set: int | None) -> list[tuple[str, int, str]]:
    """(domain label, index, prompt) of ``per_set`` held-out prompts of each set of each domain, or
    of each JSONL prompt file given as a domain (None: all of them)."""
    return [(domain_label(domain), index, prompt)
            for domain in domains for index, prompt in enumerate(domain_prompts(domain, "eval", per_set))]


# Requests per engine slot: a concurrency level is only measured while that many requests are in
# flight, and with as many requests as slots the batch is full for its first step only and then
# drains (session 45: 12 requests at "concurrency 16" never ran more than 12 rows).
REQUESTS_PER_SLOT = 2


def engine_prompts(domains: list[str], per_set: int | None, level: int) -> list[tuple[str, int, str]]:
    """The engine workload at concurrency ``level``: the batch-1 prompts (``per_set`` of each set),
    and more of every set until there are at least `REQUESTS_PER_SLOT` requests per slot (or the
    sets run out), so that continuous batching keeps ``level`` rows busy for most of the pass."""
    if per_set is None:
        return benchmark_prompts(domains, None)
    sets = sum(domain_sets(domain) for domain in domains)
    return benchmark_prompts(domains, max(per_set, math.ceil(REQUESTS_PER_SLOT * level / sets)))


def plain_references(target, tokenizer, prompts: list[str], max_new_tokens: int, references: dict) -> None:
    """Add to ``references`` (prompt -> output ids) the plain greedy ``generate`` output of every
    prompt it lacks, one prompt at a time as at batch 1."""
    missing = [prompt for prompt in dict.fromkeys(prompts) if prompt not in references]
    with torch.no_grad():
        for prompt in tqdm(missing, desc="engine references", unit="prompt", disable=not missing):
            out = target.generate(**chat_inputs(tokenizer, prompt), max_new_tokens=max_new_tokens, do_sample=False)
            references[prompt] = out[0].tolist()


def run_benchmark(target, tokenizer, drafters: dict[str, object], domains: list[str], per_set: int,
                  max_new_tokens: int, cost_model=None, references: dict | None = None,
                  baselines: list[Method] = (), reference_target=None, temperature: float = 0.0,
                  seed: int = 0) -> list[Run]:
    """Batch-1 runs; ``references`` (if given) receives each prompt's plain greedy output ids from
    ``reference_target`` (default ``target``), keyed by the prompt's text. ``temperature`` > 0 samples: every method starts
    each prompt from the same seed (``seed`` plus the prompt's number), outputs are not compared.

    ``baselines`` are more plain-decoding rows, on other targets or thread counts, interleaved
    right after AR: each method's output must equal the first output of its own target.
    """
    decoding = decoding_kwargs(temperature)
    sampled = decoding["do_sample"]
    methods = methods_for(drafters, cost_model, target_dtype=target.dtype)
    methods[1:1] = list(baselines)
    prompts = benchmark_prompts(domains, per_set)
    runs: list[Run] = []
    default_threads = torch.get_num_threads()
    reference_target = target if reference_target is None else reference_target
    with torch.no_grad():
        inputs = chat_inputs(tokenizer, prompts[0][2])
        for model in {id(m.target or target): m.target or target for m in methods}.values():
            model.generate(**inputs, max_new_tokens=4, do_sample=False)  # warm-up
        for number, (domain, index, prompt) in enumerate(tqdm(prompts, desc="benchmark", unit="prompt")):
            inputs = chat_inputs(tokenizer, prompt)
            first_output: dict[int, torch.Tensor] = {}
            for method in methods:
                model = method.target or target
                if method.policy is not None:
                    method.drafter.draft_policy = method.policy
                torch.set_num_threads(method.threads or default_threads)
                forwards = []
                hook = model.register_forward_hook(lambda *_: forwards.append(1)) if method.count_forwards else None
                if sampled:
                    torch.manual_seed(seed + number)
                start = time.perf_counter()
                try:
                    out = model.generate(**inputs, max_new_tokens=max_new_tokens, **decoding, **method.generate_kwargs)
                finally:
                    seconds = time.perf_counter() - start
                    torch.set_num_threads(default_threads)
                    if hook is not None:
                        hook.remove()
                    if method.policy is not None:
                        del method.drafter.draft_policy
                reference = first_output.setdefault(id(model), out)
                if reference is out and model is reference_target and references is not None and not sampled:
                    references[prompt] = out[0].tolist()
                stats = getattr(method.drafter, "last_speculation_stats", None)
                new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
                tau = stats.tau if stats is not None else None
                if method.count_forwards:
                    # The prefill forward yields the first token; each later forward verifies one round.
                    tau = (new_tokens - 1) / max(len(forwards) - 1, 1)
                plain = method.name == AR or any(method is b for b in baselines)
                identical = None if sampled else torch.equal(out, reference)
                runs.append(Run(method.name, domain, index, new_tokens, seconds, identical, tau, plain))
    return runs


ROUTER = "router (online, all drafters)"
# Plain batched decoding paired with itself: what the paired protocol reads when nothing differs.
CONTROL = "AR beside AR (noise control)"


def engine_configurations(drafters: dict[str, object], cost_model=None) -> list[tuple[str, object, bool]]:
    """(name, drafter or {name: drafter}, batch D-cut?) per engine row: AR, each drafter with and
    without D-cut, and with several drafters the online router over all of them (with D-cut)."""
    rows = [(AR, None, False)]
    for name, drafter in drafters.items():
        rows.append((name, drafter, False))
        if cost_model is not None:
            rows.append((f"{name} + D-cut", drafter, True))
    if len(drafters) > 1:
        rows.append((ROUTER, dict(drafters), cost_model is not None))
    return rows


def run_concurrency(target, tokenizer, drafters: dict[str, object], domains: list[str], per_set: int,
                    max_new_tokens: int, levels: list[int], references: dict, cost_model=None,
                    repeats: int = 1, temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """The prompts through the batched engine at each concurrency: throughput and losslessness
    (greedy; with ``temperature`` > 0 every request samples, each pair of passes from ``seed`` plus
    its repeat's number, and outputs are not compared). Each level serves `engine_prompts`: the
    batch-1 prompts plus more of each set where the level needs them to keep its slots full; greedy
    outputs are compared with ``references`` (prompt -> output ids), and the prompts it lacks get
    theirs from plain ``generate`` first (`plain_references`).

    Every speculative configuration is measured against its own pass of the engine's plain
    batched decoding (AR), the two served step by step in turn (`paired_engine_runs`), so both see
    the same moments of the machine: one pass of the workload lasts tens of seconds, long enough
    for a shared machine's speed to move by more than drafting gains, while one step lasts a
    fraction of a second. With ``repeats`` > 1 every pair runs that many times and each row reports
    the median of its runs (``speedups``: every one). The AR row reports the median of its runs and
    their spread (``ar_spread``: slowest and fastest tokens/s). The prompts of all domains are
    served together, in domain order, so the router faces a mixed workload.

    With drafters to measure, each level first pairs AR with a second AR pass (the `CONTROL` row):
    the ratio the protocol reads where nothing differs, against which a row near 1.0 is judged.
    Why: on the reference CPU such pairs read 0.953x-1.013x at concurrency 16 (six pairs) and
    0.979x-0.997x at 4 (engines with a drafter that never drafted, session 57), as wide as the
    gaps the "never slower than AR" target was being judged on.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    decoding = decoding_kwargs(temperature)
    eos = tokenizer.eos_token_id
    rows = []
    for level in levels:
        prompts = [prompt for _, _, prompt in engine_prompts(domains, per_set, level)]
        ids = [chat_inputs(tokenizer, prompt)["input_ids"][0].tolist() for prompt in prompts]
        expected = None
        if not decoding["do_sample"]:
            plain_references(target, tokenizer, prompts, max_new_tokens, references)
            expected = [references[prompt] for prompt in prompts]
        configurations = engine_configurations(drafters, cost_model)
        ar_runs = []
        # Every configuration but AR itself, after the control pair (none without drafters).
        paired = [(CONTROL, None, False), *configurations[1:]] if len(configurations) > 1 else []
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in paired}
        for repeat in range(repeats):
            for name, drafter, cut in paired:
                # Sampled repeats draw new texts (seed + repeat), so their median averages over texts too.
                ar, run = paired_engine_runs(target, drafter, cost_model if cut else None, level, ids,
                                             max_new_tokens, eos, expected, decoding, seed + repeat,
                                             control=name == CONTROL)
                run["speedup"] = run["tokens_per_s"] / ar["tokens_per_s"]
                run["drafters_chosen"] = run["drafters_chosen"] if isinstance(drafter, dict) else None
                ar_runs.append(ar)
                runs[name].append(run)
                logger.info("concurrency %d, %s: %.1f tokens/s against AR's %.1f beside it (%.2fx)", level, name,
                            run["tokens_per_s"], ar["tokens_per_s"], run["speedup"])
        if not ar_runs:  # no drafter: plain batched decoding alone
            ar_runs = [paired_engine_runs(target, None, None, level, ids, max_new_tokens, eos, expected, decoding, seed)[0]]
        ar_rates = [r["tokens_per_s"] for r in ar_runs]
        ar_row = {**ar_runs[0], "method": configurations[0][0], "tokens_per_s": statistics.median(ar_rates),
                  "speedup": 1.0, "lossless": all_lossless(r["lossless"] for r in ar_runs), "drafters_chosen": None,
                  "ar_runs": len(ar_runs), "ar_spread": [min(ar_rates), max(ar_rates)]}
        rows += [{"concurrency": level, **ar_row}]
        rows += [{"concurrency": level, "method": name, **_median_run(mine)} for name, mine in runs.items()]
    return rows


def _median_run(runs: list[dict]) -> dict:
    """One row from repeated runs of a configuration: median tokens/s, speedup and drafting steps,
    every speedup kept, the drafters the router chose in any run."""
    taus = [r["tau"] for r in runs if r["tau"] is not None]
    steps = [r["drafting_steps"] for r in runs if r["drafting_steps"] is not None]
    chosen = [r["drafters_chosen"] for r in runs if r["drafters_chosen"] is not None]
    return {**runs[0], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "speedup": statistics.median(r["speedup"] for r in runs), "speedups": [r["speedup"] for r in runs],
            "tau": statistics.mean(taus) if taus else None, "lossless": all_lossless(r["lossless"] for r in runs),
            "drafting_steps": statistics.median(steps) if steps else None,
            "drafters_chosen": sorted(set().union(*chosen)) if chosen else None}


def paired_engine_runs(target, drafter, cost_model, level: int, ids: list[list[int]], max_new_tokens: int, eos,
                       expected: list | None, decoding: dict | None = None, seed: int = 0,
                       control: bool = False) -> tuple[dict, dict | None]:
    """The whole workload through plain batched decoding and through ``drafter``'s engine at once,
    step by step in turn: (AR's result, the drafter's), each with throughput, tau, losslessness
    against ``expected`` (None: not checked). ``decoding``: every request's settings (greedy by
    default; see `decoding_kwargs`); sampled pairs start from ``seed``.

    The engine that has spent less time so far takes the next step, so both get equal shares of
    the machine for as long as both run; each one's throughput counts only its own steps. The
    faster one finishes first and the other's remaining steps run alone (at a 1.2x speedup, a
    sixth of the slower one's time). With ``drafter=None`` only the AR engine runs, unless
    ``control``: then a second AR engine runs beside it, and its result comes second.
    """
    from .generation import BatchDCutPolicy, SpeculativeEngine

    if control and drafter is not None:
        raise ValueError("control pairs plain batched decoding with itself: pass drafter=None.")
    policy = BatchDCutPolicy(cost_model) if cost_model is not None else None
    engines = [SpeculativeEngine(target, None, max_batch_size=level)]
    if drafter is not None or control:
        engines.append(SpeculativeEngine(target, drafter, max_batch_size=level, policy=policy))
    decoding = decoding or decoding_kwargs(0.0)
    for engine in engines:
        for prompt in ids:
            engine.submit(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos, **decoding)
    if decoding["do_sample"]:
        torch.manual_seed(seed)
    seconds = [0.0] * len(engines)
    outputs = [[list(prompt) for prompt in ids] for _ in engines]
    while any(engine.has_work for engine in engines):
        turn = min((i for i, engine in enumerate(engines) if engine.has_work), key=lambda i: seconds[i])
        start = time.perf_counter()
        events = engines[turn].step()
        seconds[turn] += time.perf_counter() - start
        for event in events:
            outputs[turn][event.request] += event.tokens
    results = [_engine_result(engine, out, ids, elapsed, expected, policy if i else None)
               for i, (engine, out, elapsed) in enumerate(zip(engines, outputs, seconds))]
    return results[0], (results[1] if len(results) > 1 else None)


def _engine_result(engine, outputs: list[list[int]], ids: list[list[int]], seconds: float, expected: list | None,
                   policy) -> dict:
    """Throughput, tau and losslessness of one engine's pass over the workload."""
    new_tokens = sum(len(out) - len(prompt) for out, prompt in zip(outputs, ids))
    accepted = [a for entry in engine.stats for a in entry["accepted"]]
    return {
        "prompts": len(ids), "tokens_per_s": new_tokens / seconds,
        "tau": (sum(accepted) + len(accepted)) / len(accepted) if accepted else None,
        "lossless": None if expected is None else all(out == reference for out, reference in zip(outputs, expected)),
        "drafting_steps": len(policy.windows) if policy is not None else None,
        "drafters_chosen": sorted({entry["drafter"] for entry in engine.stats}),
    }


def summarise(runs: list[Run]) -> list[dict]:
    """One row per (method, domain): medians over prompts, speedups against the fastest plain
    decoding of the same prompt (AR, or a baseline on another target or thread count)."""
    ar: dict = {}
    for r in runs:
        if r.plain:
            best = ar.get((r.domain, r.prompt_index))
            ar[(r.domain, r.prompt_index)] = r if best is None or r.tokens_per_s > best.tokens_per_s else best
    rows = []
    for method in dict.fromkeys(r.method for r in runs):
        for domain in dict.fromkeys(r.domain for r in runs):
            mine = [r for r in runs if r.method == method and r.domain == domain]
            if not mine:
                continue
            taus = [r.tau for r in mine if r.tau is not None]
            rows.append({
                "method": method,
                "domain": domain,
                "prompts": len(mine),
                "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
                "speedup": statistics.median(r.tokens_per_s / ar[(r.domain, r.prompt_index)].tokens_per_s for r in mine),
                "tau": statistics.mean(taus) if taus else None,
                "lossless": all_lossless(r.identical for r in mine),
            })
    return rows


LOSSLESS_LABELS = {True: "yes", False: "NO", None: "sampled"}


def format_table(rows: list[dict], group: str = "domain") -> str:
    """Terminal table of summary rows grouped by ``domain`` (batch 1) or ``concurrency`` (engine)."""
    header = f"{'method':48} {group[:6]:>6} {'n':>3} {'tau':>5} {'tok/s':>7} {'speedup':>8} {'lossless':>8}"
    lines = [header, "-" * len(header)]
    for row in rows:
        tau = f"{row['tau']:.2f}" if row["tau"] is not None else "-"
        lines.append(f"{row['method'][:48]:48} {str(row[group]):>6} {row['prompts']:>3} {tau:>5} "
                     f"{row['tokens_per_s']:7.1f} {row['speedup']:7.2f}x {LOSSLESS_LABELS[row['lossless']]:>8}")
    return "\n".join(lines)


def write_chart(rows: list[dict], path: Path, concurrency: list[dict] | None = None,
                subtitle: str = "greedy, reference target") -> bool:
    """Speedup by method and domain (batch 1) and, given engine rows, speedup by method and
    concurrency, as grouped bar charts, each titled with ``subtitle`` (the decoding and the target);
    False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no chart written")
        return False
    panels = [(rows, "domain", "batch 1 (target.generate)")]
    if concurrency:
        panels.append((concurrency, "concurrency", "engine, mixed workload"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 1, 6), squeeze=False)
    # One colour per method across both panels, so that a drafter reads alike at batch 1 and in the engine.
    colours = {method: i for i, method in enumerate(dict.fromkeys(r["method"] for p, _, _ in panels for r in p))}
    for ax, (panel_rows, group, title) in zip(axes[0], panels):
        _grouped_bars(ax, panel_rows, group, colours)
        ax.set_title(f"{title}, {subtitle}")
    axes[0][0].set_ylabel("speedup (1.0 = the fastest plain decoding)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _grouped_bars(ax, rows: list[dict], group: str, colours: dict[str, int]) -> None:
    from matplotlib import colormaps

    methods = list(dict.fromkeys(r["method"] for r in rows))
    groups = list(dict.fromkeys(r[group] for r in rows))
    width = 0.8 / len(methods)
    # 20 distinct colours: the default cycle of 10 gave two of the 11 batch-1 methods the same one.
    palette = colormaps["tab20"]
    for i, method in enumerate(methods):
        values = [next((r["speedup"] for r in rows if r["method"] == method and r[group] == g), 0.0) for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=_short_name(method),
               color=palette(colours[method] % palette.N))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(groups))],
                  [f"{group} {g}" if group == "concurrency" else str(g) for g in groups])
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, frameon=False)


def _short_name(method: str) -> str:
    """``<target>-AngelSpec-<kind>`` drafter directory names read as ``<kind>`` in charts."""
    return method.split("-AngelSpec-", 1)[-1]


def write_report(runs: list[Run], rows: list[dict], path: Path, settings: dict, concurrency: list[dict] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        **settings,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "summary": rows,
        "concurrency": concurrency or [],
        "runs": [{**r.__dict__, "tokens_per_s": r.tokens_per_s} for r in runs],
    }
    path.write_text(json.dumps(report, indent=2))
