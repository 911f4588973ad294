"""The ``angelspec-hf`` command line.

``angelspec-hf bench`` (the README's main job) runs plain generate, prompt lookup and each drafter
on held-out chat, code and math prompts, interleaved, greedy, and reports tau, tokens/s, speedup
and losslessness as a table, a JSON report and a PNG chart. ``rollouts``, ``train`` and ``eval``
prepare data, train drafters and measure them.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModel, PreTrainedModel

from . import DFlyDrafter, MTPDrafter
from .modeling_angelspec_common import cpu_has_bfloat16_units
from .reference import REFERENCE_TARGET_ID, load_reference_target

logger = logging.getLogger("angelspec_hf")

def shipped_drafter_dirs(root: Path) -> list[Path]:
    """Drafter directories under ``modeling/`` (config.json plus model.safetensors)."""
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if (path / "config.json").exists() and (path / "model.safetensors").exists())


def verification_kernels(target: PreTrainedModel, stock: bool = False) -> str:
    """Our kernels for verifying drafts on ``target``: "exact" (exact verification in reduced
    precision, without which bfloat16 output is not token-identical, generation/exact.py), "packed"
    (oneDNN packed linears for a float32 target on a CPU, faster verify forwards,
    generation/packed.py), or "stock" (none: asked for with ``stock``, or nothing applies)."""
    from .generation.packed import packing_available

    if stock:
        return "stock"
    if target.dtype != torch.float32:
        return "exact"
    return "packed" if target.device.type == "cpu" and packing_available() else "stock"


def install_verification_kernels(target: PreTrainedModel, stock: bool = False) -> str:
    """Install `verification_kernels` on ``target``; returns which."""
    from .generation import make_verification_exact, pack_linear_weights

    kernels = verification_kernels(target, stock)
    if kernels == "exact":
        make_verification_exact(target)
    elif kernels == "packed":
        pack_linear_weights(target)
    return kernels


def faster_verification_dtype(target_name: str, threads: int, stock: bool = False,
                              rounds: int = 12) -> tuple[str, dict[str, float]]:
    """The dtype this hardware verifies drafts faster in (bfloat16 only by more than
    `BFLOAT16_MARGIN`), and the median milliseconds each took to verify a draft of 8 at context 256
    (batch 1, ``threads`` threads, with our verification kernels unless ``stock``: exact ones in
    bfloat16, packed linears in float32). Verification is what speculative decoding spends its time on.

    The two are timed turn by turn (`interleaved_verify_seconds`, ``rounds`` each) and bfloat16 is
    chosen on the median of the rounds' bfloat16 / float32 ratios. Read from two cost profiles
    measured a minute apart, the choice once followed a slow spell on the host instead: float32 at
    130 ms against bfloat16's 78.5 (session 48; 67.8 against 67.3 in a quiet hour), and batch 1 ran
    the slower dtype. Both copies are loaded at once for it, 1.5x the float32 target's memory, and
    dropped on return.

    Neither dtype is faster everywhere: bfloat16 verified 8 drafts at 1.14x a plain step on a CPU with
    bfloat16 units (avx512_bf16), while on one with AVX2 only (emulated bfloat16) a 9-token bfloat16
    forward took 303 ms against float32's 134 (one thread, nothing else running): with plain float32
    decoding at 61 ms a token there, a drafter verified in bfloat16 needed tau above 5 to break even.

    Why a margin: in bfloat16 the exact kernels (token identity) also slow every other forward
    of the speculative rows, and plain decoding with them ran at 0.94x-0.96x the stock kernels that
    the bench's speedups are then measured against, while float32's packed linears make plain
    decoding faster, not slower. On the reference avx512_bf16 EPYC a 0.7% verification edge for
    bfloat16 (67.3 against 67.8 ms, session 41) chose it, and every batch-1 drafter row ran below the
    float32 run of the night before (MTP + D-cut on chat 1.34x against 1.54x, DFly + D-cut on math
    1.61x against 2.02x).
    """
    from .errors import ExactVerificationError
    from .generation import interleaved_verify_seconds

    torch.set_num_threads(threads)
    targets = {}
    for dtype in DTYPES:
        targets[dtype] = load_target_model(target_name, dtype)
        try:
            install_verification_kernels(targets[dtype], stock)
        except ExactVerificationError as error:
            # Without exact kernels bfloat16 speculative output is not token-identical, so it is no choice.
            logger.warning("bfloat16 cannot verify drafts exactly on %s (%s): batch 1 runs in float32.", target_name, error)
            return "float32", {}
    seconds = interleaved_verify_seconds(targets, new_tokens=9, context=256, rounds=rounds)
    ratio = statistics.median([b / f for b, f in zip(seconds["bfloat16"], seconds["float32"])])
    verify_ms = {dtype: 1000 * statistics.median(times) for dtype, times in seconds.items()}
    return ("bfloat16" if ratio < 1.0 - BFLOAT16_MARGIN else "float32"), verify_ms


def drafter_dtype(target: PreTrainedModel, choice: str = "auto") -> torch.dtype:
    """The dtype drafters compute in beside ``target``: ``choice``, or for ``auto`` bfloat16 beside a
    float32 target on a CPU with bfloat16 units and the target's dtype elsewhere.

    Drafting at batch 1 reads every drafter weight once per step, so it is bound by memory, and
    bfloat16 halves what is read; the draft's precision cannot change the output (the target
    verifies every token). Measured on an AMD EPYC with avx512_bf16 (2026-12-04, one thread, the
    shipped MTP-TTT3 on 3 MT-Bench prompts, two interleaved passes each): a draft 9.1 -> 7.3 ms,
    generate 3.5% faster, the same output; on 6 MT-Bench prompts 4.6%, DFly-Block8 on 4 code
    prompts 5.5%. On AVX2-only CPUs bfloat16 is emulated and slower (`warn_if_drafting_emulated`),
    hence the target's dtype there."""
    if choice != "auto":
        return getattr(torch, choice)
    if target.dtype == torch.float32 and target.device.type == "cpu" and cpu_has_bfloat16_units():
        return torch.bfloat16
    return target.dtype


def bench_drafters(target: PreTrainedModel, modeling_dir: Path, extra: list[str],
                   dtype: torch.dtype | None = None) -> dict[str, PreTrainedModel]:
    """The shipped drafters (and ``extra`` ones) in ``dtype`` (default: the target's)."""
    paths = shipped_drafter_dirs(modeling_dir) + [Path(p) for p in extra]
    dtype = dtype or target.dtype
    drafters = {path.name: AutoModel.from_pretrained(path, dtype=dtype).eval() for path in paths}
    if not drafters:
        logger.warning("No trained drafters under %s: benchmarking untrained ones (tau near 1).", modeling_dir)
        torch.manual_seed(0)
        drafters = {
            "MTP (untrained)": MTPDrafter.from_target(target, num_draft_tokens=3).eval(),
            "DFly-Block8 (untrained)": DFlyDrafter.from_target(target, block_size=8).eval(),
        }
    return drafters


def run_bench(args: argparse.Namespace) -> int:
    from .benchmark import (
        Method,
        decoding_kwargs,
        format_table,
        run_benchmark,
        run_concurrency,
        summarise,
        write_chart,
        write_report,
    )
    from .generation import load_or_profile

    # --quick is a smoke run (every method, every domain, losslessness checked), not a measurement:
    # 2 prompts a set at 64 tokens took 5.0-8.2 minutes on the reference 2-core machine, where the
    # issue asks for about 2.
    domains = args.prompts or args.domains
    # A bundled set has dozens of held-out prompts, so it gets a default share; a prompt file is run whole.
    per_set = args.per_set if args.per_set is not None else (None if args.prompts else DEFAULT_PER_SET)
    per_set, max_new_tokens = QUICK if args.quick else (per_set, args.max_new_tokens)
    levels = [] if args.quick else args.concurrency
    # Refuse a bad temperature or prompt file before loading anything.
    for option, check in (("--temperature", lambda: decoding_kwargs(args.temperature)),
                          ("--per-set", lambda: check_positive(per_set)),
                          ("--prompts", lambda: check_prompt_files(args.prompts or []))):
        try:
            check()
        except ValueError as error:
            raise SystemExit(f"{option}: {error}") from None
    name = target_display_name(args.target)
    engine_threads = args.engine_threads or torch.get_num_threads()
    threads = args.threads or torch.get_num_threads()
    verify_ms = {}
    if args.dtype == "auto":
        args.dtype, verify_ms = faster_verification_dtype(args.target, threads, stock=args.stock_kernels)
        if verify_ms:
            print(f"batch-1 dtype: {args.dtype} (a draft of 8 verified at context 256, median of turn-by-turn timings: "
                  + ", ".join(f"{ms:.1f} ms in {dtype}" for dtype, ms in verify_ms.items()) + " on this hardware)")
        else:
            print(f"batch-1 dtype: {args.dtype} (bfloat16 cannot verify this target exactly)")
    target, tokenizer = load_target(args.target, args.dtype)
    # A copy for plain decoding with the stock kernels, only where ours are installed.
    stock = copy.deepcopy(target) if verification_kernels(target, args.stock_kernels) != "stock" else None
    kernels = install_verification_kernels(target, args.stock_kernels)
    exact = kernels == "exact"
    baselines = []
    if kernels != "stock":
        # bfloat16 verification is token-identical only with row-stable kernels (generation/exact.py),
        # float32 verifies faster with packed linears (generation/packed.py); plain decoding of the stock
        # target is measured beside it, so that AR is not slowed (or sped up) by them.
        baselines.append(Method(f"AR, {args.dtype} stock kernels ({engine_threads} threads)", target=stock,
                                threads=engine_threads))
    engine_target = target
    if args.engine_dtype != args.dtype or exact:
        engine_target = load_target(args.target, args.engine_dtype)[0]
        install_verification_kernels(engine_target, args.stock_kernels)
        baselines.append(Method(f"AR, {args.engine_dtype} target ({engine_threads} threads)", target=engine_target,
                                threads=engine_threads))
    draft_dtype = drafter_dtype(target, args.drafter_dtype)
    drafters = bench_drafters(target, Path(args.modeling_dir), args.drafter, draft_dtype)
    torch.set_num_threads(threads)
    cost_model = None if args.no_dcut else load_or_profile(target, name, batch_sizes=(1,))
    references: dict = {}
    runs = run_benchmark(target, tokenizer, drafters, domains, per_set, max_new_tokens, cost_model, references,
                         baselines=baselines, reference_target=engine_target, temperature=args.temperature,
                         seed=args.seed)
    rows = summarise(runs)
    print(format_table(rows))
    torch.set_num_threads(engine_threads)
    concurrency = []
    # The engine's drafters follow the same rule beside its target: bfloat16 drafters beside the
    # float32 engine on a CPU with bfloat16 units (measured at concurrency 4 with D-cut, each
    # paired step by step with plain batched decoding and float32 drafters: DFlash 1.106x against
    # 1.062x, DFly 1.112x against 1.057x, MTP 1.020x against 0.991x, the same outputs).
    engine_draft_dtype = drafter_dtype(engine_target, args.drafter_dtype)
    if levels:
        engine_drafters = drafters if engine_draft_dtype == draft_dtype else bench_drafters(
            engine_target, Path(args.modeling_dir), args.drafter, engine_draft_dtype)
        engine_cost = None if args.no_dcut else load_or_profile(engine_target, name)
        concurrency = run_concurrency(engine_target, tokenizer, engine_drafters, domains, per_set, max_new_tokens,
                                      levels, references, engine_cost, repeats=args.engine_repeats,
                                      temperature=args.temperature, seed=args.seed)
    if concurrency:
        print()
        print(format_table(concurrency, group="concurrency"))
    report = Path(args.report)
    write_report(runs, rows, report, {"target": name, "dtype": args.dtype,
                                      "drafter_dtype": str(draft_dtype).removeprefix("torch."),
                                      "engine_drafter_dtype": str(engine_draft_dtype).removeprefix("torch."),
                                      "exact_kernels": exact, "kernels": kernels,
                                      "threads": threads, "engine_dtype": args.engine_dtype,
                                      "temperature": args.temperature, "seed": args.seed,
                                      "engine_threads": engine_threads, "per_set": per_set, "domains": domains,
                                      "max_new_tokens": max_new_tokens, "verify_ms_by_dtype": verify_ms}, concurrency)
    chart = report.with_suffix(".png")
    decoding = "greedy" if args.temperature == 0 else f"sampled at T={args.temperature:g}"
    written = write_chart(rows, chart, concurrency, subtitle=f"{decoding}, {name.rstrip('/').split('/')[-1]}")
    print(f"report written to {report}" + (f", chart to {chart}" if written else ""))
    return 0 if all(row["lossless"] is not False for row in rows + concurrency) else 1


DTYPES = ("float32", "bfloat16")
# How much faster bfloat16 must verify than float32 for `bench --dtype auto` to choose it
# (see `faster_verification_dtype`): about what its exact kernels cost plain decoding.
BFLOAT16_MARGIN = 0.05
QUICK = (1, 48)  # prompts per set, new tokens of `bench --quick`
DEFAULT_PER_SET = 4  # held-out prompts of each bundled set in `bench`


def check_positive(count: int | None) -> None:
    if count is not None and count < 1:
        raise ValueError(f"must be at least 1 (or left out), got {count}.")


def check_prompt_files(paths: list[str]) -> None:
    """Refuse `bench` or `eval` `--prompts` files that cannot be read as prompts, or whose names collide (rows
    are labelled by file name)."""
    from .prompts import domain_label, domain_prompts

    for path in paths:
        if not domain_prompts(path, "all"):
            raise ValueError(f"{path} has no prompts.")
    labels = [domain_label(path) for path in paths]
    if len(set(labels)) < len(labels):
        raise ValueError(f"prompt files are reported by name and these share one: {paths}; rename one.")


def target_display_name(name: str) -> str:
    return REFERENCE_TARGET_ID if name == "reference" else name


def run_profile(args: argparse.Namespace) -> int:
    from .generation import load_or_profile
    from .generation.cost_model import profile_path

    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, args.dtype)
    # With the kernels `bench` and the engine verify with, so that the profile is the one they look up
    # (it is keyed by them) and prices their forwards, not the stock ones.
    install_verification_kernels(target, args.stock_kernels)
    model = load_or_profile(target, target_display_name(args.target), refresh=True)
    for batch, grid in zip(model.batch_sizes, model.seconds):
        for tokens, row in zip(model.tokens, grid):
            print(f"batch {batch:2d}, {tokens:3d} new tokens: "
                  + "  ".join(f"ctx {c}: {s * 1000:7.1f} ms" for c, s in zip(model.contexts, row)))
    print(f"profile written to {profile_path(model.target, target.device)}")
    return 0


def run_push(args: argparse.Namespace) -> int:
    from .hub import push_drafter

    info = push_drafter(args.directory, args.repo_id, private=args.private, create_pr=args.create_pr)
    print(f"pushed {args.directory} to {args.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from .interop import (
        export_angelspec,
        export_angelspec_mtp,
        export_dflash,
        export_eagle3,
        export_transformers_dflash,
        load_angelspec,
        load_angelspec_mtp,
        load_dflash,
        load_eagle3,
    )

    target = load_target_model(args.target) if args.target else None
    if args.to == "dflash":
        export_dflash(AutoModel.from_pretrained(args.source), args.destination)
    elif args.to == "eagle3":
        export_eagle3(AutoModel.from_pretrained(args.source), args.destination, target=target)
    elif args.to == "angelspec":
        drafter = AutoModel.from_pretrained(args.source)
        if drafter.config.model_type == "angelspec_mtp":
            export_angelspec_mtp(drafter, args.destination, target=target)
        else:
            export_angelspec(drafter, args.destination)
    elif args.to == "transformers-dflash":
        export_transformers_dflash(AutoModel.from_pretrained(args.source), args.destination)
    else:
        raw = json.loads((Path(args.source) / "config.json").read_text())
        architecture = (raw.get("architectures") or [""])[0]
        if architecture == "LlamaForCausalLMEagle3":
            drafter = load_eagle3(args.source, target=target)
        elif architecture in ("Qwen3DFlyModel", "DFlyDraftModel") or raw.get("model_arch") == "dflare":
            drafter = load_angelspec(args.source, block_size=args.block_size)
        elif architecture == "DFlashDraftModel":
            drafter = load_dflash(args.source, block_size=args.block_size)
        elif architecture == "MTPDraftModel" or raw.get("model_type") == "mtp":
            drafter = load_angelspec_mtp(args.source, target=target)
        else:
            raise SystemExit(f"{args.source}: unknown drafter architecture {architecture!r} (reads DFlashDraftModel, "
                             "Qwen3DFlyModel/DFlyDraftModel, DFlare, MTPDraftModel and LlamaForCausalLMEagle3).")
        drafter.save_pretrained(args.destination)
    print(f"converted {args.source} to {args.to} format in {args.destination}")
    return 0


def load_target(name: str, dtype: str = "float32"):
    """``reference`` (the bundled SmolLM2-135M-Instruct) or a local directory / cached Hub id, with its tokenizer."""
    if name == "reference":
        # Loaded in its dtype, not cast after loading: `.to(bfloat16)` also rounds the RoPE inverse
        # frequencies (float32 buffers under from_pretrained), a different model from the one users load.
        return load_reference_target(getattr(torch, dtype))
    from transformers import AutoTokenizer

    return load_target_model(name, dtype), AutoTokenizer.from_pretrained(name)


def load_target_model(name: str, dtype: str = "float32"):
    """The target model alone (what format conversion needs: a target saved without a tokenizer works)."""
    if name == "reference":
        return load_reference_target(getattr(torch, dtype))[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).eval()


def run_rollouts(args: argparse.Namespace) -> int:
    from .prompts import PROMPT_SETS, load_prompts
    from .training.data import generate_rollouts, read_records

    if args.feature_cache and args.dtype != "float32":
        # The cache is keyed by the target's dtype: bfloat16 states would sit where float32 training never looks.
        raise SystemExit(f"rollouts --feature-cache keeps float32 target states for training; with --dtype {args.dtype} "
                         "they would be computed in that dtype and never read. Drop --feature-cache (training "
                         "computes the states once, in float32, with `train --feature-cache`) or decode in float32.")
    target, tokenizer = load_target(args.target, args.dtype)
    caches = list(recipe_feature_caches(target, args.feature_cache, args.recipe, args.target_layers).values()) if args.feature_cache else []
    options = {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "feature_caches": caches,
               "seq_len": args.rollout_length}
    if args.magpie:
        from .training.data import synthesize_chat_prompts

        # Kept beside, not inside, the rollout folder: its rows are prompts, not rollouts.
        synthetic = Path(args.output_dir).parent / "prompts" / f"{Path(args.output_dir).name}-magpie.jsonl"
        existing = [row["prompt"] for row in read_records(synthetic)] if synthetic.exists() else []
        held_out = {p for name in PROMPT_SETS for p in load_prompts(name, "eval")}
        prompts = synthesize_chat_prompts(target, tokenizer, args.magpie, batch_size=args.batch_size,
                                          existing=existing, exclude=held_out, opening=args.magpie_opening,
                                          max_new_tokens=args.magpie_turn_tokens)
        synthetic.parent.mkdir(parents=True, exist_ok=True)
        synthetic.write_text("".join(json.dumps({"prompt": p, "domain": args.magpie_domain}) + "\n" for p in prompts))
        speed = generate_rollouts(target, tokenizer, prompts, Path(args.output_dir) / "magpie-train.jsonl",
                                  domain=args.magpie_domain, **options)
        print(f"magpie: {speed['new_tokens']} new tokens at {speed['tokens_per_s']:.1f} tokens/s")
    for name in args.prompts:
        domain = PROMPT_SETS.get(name, Path(name).stem)
        out = Path(args.output_dir) / f"{Path(name).stem}-train.jsonl"
        speed = generate_rollouts(target, tokenizer, load_prompts(name, "train"), out, domain=domain, **options)
        print(f"{name}: {speed['new_tokens']} new tokens at {speed['tokens_per_s']:.1f} tokens/s")
    return 0


def run_train(args: argparse.Namespace) -> int:
    from .training.corpus import framed_code_sequences
    from .training.data import MIN_TRAINED_TOKENS, rollout_sequences
    from .training.recipes import RECIPES, Recipe, continued_drafter, train_drafter

    if args.grow_layers is not None and not args.from_drafter:
        raise SystemExit("--grow-layers grows a trained drafter: give it with --from DIR (a new one takes --layers)")
    target, tokenizer = load_target(args.target)
    rollouts = rollout_sequences(jsonl_files(args.data), seq_len=args.rollout_length) if args.data else []
    corpus_tokens = args.corpus_tokens
    if corpus_tokens is None:
        # Framed standard-library code suits the code/math block drafters, not the chat MTP drafter.
        corpus_tokens = 400_000 if RECIPES[args.recipe][0] == "dfly" else 0
    corpus = framed_code_sequences(tokenizer, seq_len=args.corpus_length, max_tokens=corpus_tokens) if corpus_tokens else []
    if not rollouts and not corpus:
        if args.data:
            raise SystemExit(f"no training data: no row of --data has {MIN_TRAINED_TOKENS} response tokens within "
                             f"--rollout-length {args.rollout_length}; make longer rollouts (rollouts --max-new-tokens), "
                             "raise --rollout-length, or add --corpus-tokens > 0")
        raise SystemExit("no training data: give --data with rollouts and/or --corpus-tokens > 0")
    recipe = Recipe(name=args.recipe, block_size=args.block_size, num_hidden_layers=args.layers,
                    num_draft_tokens=args.draft_tokens, draft_vocab_size=args.draft_vocab_size,
                    lk_steps=args.lk_steps, tv_steps=args.tv_steps, batch_size=args.batch_size,
                    num_anchors=args.anchors, learning_rate=args.learning_rate, seed=args.seed,
                    feature_cache=args.feature_cache, bf16=args.bf16, target_layer_ids=args.target_layers,
                    weight_decay=args.weight_decay)
    drafter = continued_drafter(args.from_drafter, recipe, args.grow_layers) if args.from_drafter else None
    finish = (rollouts + corpus[: len(rollouts) // 2]) if rollouts else None
    train_drafter(target, corpus + rollouts * 2, args.output, recipe, pad_token_id=tokenizer.eos_token_id,
                  finish_rows=finish, resume=args.resume, drafter=drafter)
    if args.eval_per_set:
        domains = ["chat"] if RECIPES[args.recipe][0] == "mtp" else ["code", "math"]
        evaluate_into_card(target, tokenizer, Path(args.output) / "final", domains, args.eval_per_set, 128)
    return 0


def jsonl_files(paths: list[str]) -> list[Path]:
    """`training.data.jsonl_files` for a command's arguments: a missing path ends the command."""
    from .training.data import jsonl_files as files_in

    try:
        return files_in(paths)
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


def recipe_feature_caches(target, directory: str, recipes: list[str], target_layer_ids: list[int] | None = None) -> dict:
    """Recipe name -> a `FeatureCache` keeping the target layers that recipe's drafter reads (once per
    name): ``target_layer_ids`` when given (`--target-layers`), else the recipe's defaults."""
    from .training.features import FeatureCache
    from .training.recipes import Recipe, new_drafter

    def layers(name: str) -> list[int]:
        return new_drafter(target, Recipe(name=name, target_layer_ids=target_layer_ids)).config.target_layer_ids

    return {name: FeatureCache(directory, target, layers(name)) for name in recipes}


def layer_list(text: str) -> list[int]:
    """``"1,8,14"`` -> ``[1, 8, 14]`` (argparse type of `--target-layers`)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 1,8,14,20,27, got {text!r}")


def run_corpus(args: argparse.Namespace) -> int:
    from .prompts import load_prompts
    from .training.corpus import SOURCES, corpus_rows, fill_feature_cache, write_rows
    from .training.data import rollout_sequences

    target, tokenizer = load_target(args.target)
    extra_prompts = [prompt for f in jsonl_files(args.chat_prompts) for prompt in load_prompts(str(f), "all")]
    written = []
    for source in args.source:
        rows = corpus_rows(tokenizer, source, args.tokens, seq_len=args.seq_len, seed=args.seed, root=args.root,
                           extra_prompts=extra_prompts)
        name = source if source in SOURCES else Path(source).stem
        out = write_rows(rows, Path(args.output_dir) / f"{name}-corpus.jsonl")
        tokens = sum(len(r["response_ids"]) for r in rows)
        print(f"{source}: {len(rows)} rows, {tokens} trained tokens -> {out}")
        written.append(out)
    if args.feature_cache:
        for name, cache in recipe_feature_caches(target, args.feature_cache, args.recipe, args.target_layers).items():
            speed = fill_feature_cache(target, cache, rollout_sequences(written, seq_len=args.rollout_length),
                                       args.batch_size)
            print(f"target states of {speed['tokens']} tokens for recipe {name} in {speed['seconds']:.0f} s "
                  f"({speed['tokens_per_s']:.0f} tokens/s) -> {cache.directory}")
    return 0


def run_draft_vocab(args: argparse.Namespace) -> int:
    from .training.corpus import framed_code_sequences
    from .training.data import rollout_sequences
    from .training.recipes import frequent_token_ids, token_counts

    target, tokenizer = load_target(args.target)
    drafter = AutoModel.from_pretrained(args.drafter).eval()
    if drafter.config.model_type != "angelspec_dfly":
        raise SystemExit(f"{args.drafter}: only DFly-family drafters take a draft vocabulary after training; "
                         "an MTP drafter learns its reduced head, so pass --draft-vocab-size to `train`.")
    files = jsonl_files(args.data)
    rows = rollout_sequences(files, seq_len=args.rollout_length) if files else []
    if args.corpus_tokens:
        rows += framed_code_sequences(tokenizer, seq_len=320, max_tokens=args.corpus_tokens)
    if not rows:
        raise SystemExit("no data to count tokens in: give --data with rollouts and/or --corpus-tokens > 0")
    counts = token_counts(rows, drafter.config.vocab_size)
    # A drafter trained over a reduced vocabulary (the target renormalised over it) narrows to the
    # most frequent of its own tokens: the others were never its targets.
    narrowing = drafter.config.uses_reduced_vocab and args.size < drafter.config.draft_vocab_size
    ids = frequent_token_ids(counts, args.size, among=drafter.draft_vocab if narrowing else None)
    drafter.set_draft_vocab(ids)
    covered = counts[ids].sum().item() / max(counts.sum().item(), 1)
    drafter.save_pretrained(args.drafter)
    print(f"{args.drafter}: drafts over {ids.numel()} tokens, covering {covered:.2%} of {counts.sum().item()} "
          f"response tokens counted")
    return 0


def measure_drafter(target, tokenizer, drafter_dir, domains: list[str], per_set: int, max_new_tokens: int):
    """Greedy tau and identity of a saved drafter on the held-out prompts of each domain (bundled, or
    a JSONL prompt file: see `held_out_prompts`)."""
    from .evaluation import evaluate_drafter
    from .prompts import domain_label, held_out_prompts

    drafter = AutoModel.from_pretrained(drafter_dir, dtype=target.dtype).eval()
    prompts = {domain_label(domain): held_out_prompts(domain, per_set) for domain in domains}
    return evaluate_drafter(target, tokenizer, drafter, prompts, max_new_tokens=max_new_tokens)


def evaluate_into_card(target, tokenizer, drafter_dir: Path, domains: list[str], per_set: int, max_new_tokens: int):
    """Measure a saved drafter on held-out prompts and write the numbers into its model card."""
    from .hub import RESULTS_FILE, write_model_card

    results = measure_drafter(target, tokenizer, drafter_dir, domains, per_set, max_new_tokens)
    from .generation.exact import is_verification_exact

    setup = {"dtype": str(target.dtype).removeprefix("torch."), "exact_verification": is_verification_exact(target),
             "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads()}
    summary = {domain: {"tau": round(r.tau, 3), "prompts": r.prompts, "lossless": r.identical == r.prompts,
                        "speedup": round(r.seconds_plain / r.seconds_speculative, 3), **setup}
               for domain, r in results.items()}
    (Path(drafter_dir) / RESULTS_FILE).write_text(json.dumps(summary, indent=2))
    write_model_card(drafter_dir)
    return results


def run_eval(args: argparse.Namespace) -> int:
    domains = args.prompts or args.domains
    # A prompt file's first row is held out, so a readable file always has a prompt to measure.
    for option, check in (("--per-set", lambda: check_positive(args.per_set)),
                          ("--prompts", lambda: check_prompt_files(args.prompts or []))):
        try:
            check()
        except ValueError as error:
            raise SystemExit(f"{option}: {error}") from None
    target, tokenizer = load_target(args.target, args.dtype)
    if args.dtype != "float32":
        from .generation.exact import make_verification_exact

        make_verification_exact(target)  # otherwise reduced precision is not token-identical (generation/exact.py)
    measure = evaluate_into_card if args.card else measure_drafter
    results = measure(target, tokenizer, Path(args.drafter), domains, args.per_set, args.max_new_tokens)
    report = {"drafter": str(args.drafter), "target": args.target, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "torch_threads": torch.get_num_threads(), "domains": {d: r.as_dict() for d, r in results.items()}}
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(report, indent=2))
    for domain, result in results.items():
        print(f"{domain:5} tau {result.tau:.3f}  lossless {result.identical}/{result.prompts}  "
              f"speculative {result.new_tokens / result.seconds_speculative:.1f} tok/s  "
              f"plain {result.new_tokens / max(result.seconds_plain, 1e-9):.1f} tok/s")
    print(f"report written to {args.report}")
    return 0 if all(r.identical == r.prompts for r in results.values()) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="angelspec-hf", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="speedup benchmark on the reference target (the main job)")
    bench.add_argument("--target", default="reference")
    bench.add_argument("--domains", nargs="+", default=["chat", "code", "math"], choices=["chat", "code", "math"])
    bench.add_argument("--prompts", nargs="+", metavar="FILE",
                       help='JSONL prompt files (one {"prompt": ...} a line) to measure instead of the bundled '
                            "sets; each is a domain named after the file, all its prompts unless --per-set")
    bench.add_argument("--per-set", type=int, default=None,
                       help=f"held-out prompts per bundled prompt set (default {DEFAULT_PER_SET}), or the first "
                            "prompts of each --prompts file")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--quick", action="store_true",
                       help=f"{QUICK[0]} prompt per set, {QUICK[1]} new tokens, no engine: a smoke run of every method")
    bench.add_argument("--modeling-dir", default="modeling", help="directory of shipped drafters")
    bench.add_argument("--drafter", action="append", default=[], help="another drafter directory (repeatable)")
    bench.add_argument("--report", default="reports/bench.json")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="0 (default): greedy, every output checked against plain decoding; above 0 every "
                            "method samples at this temperature with top-k 50 (transformers' default) from the same "
                            "seed per prompt, and the engine's pairs from --seed (speed only: sampled outputs cannot be "
                            "compared token for token)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the first prompt when sampling")
    bench.add_argument("--threads", type=int, default=1,
                       help="torch threads at batch 1 (0: torch's default). One thread decodes and verifies the "
                            "bfloat16 target fastest here, its kernels being many small operations")
    bench.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                       help="batch-1 target (and drafter) dtype; auto: the one this hardware verifies a draft faster in, "
                            "timed turn by turn, 12 rounds (bfloat16 on CPUs with bfloat16 units and on GPUs, float32 on "
                            "AVX2-only CPUs, where bfloat16 verification took 2.3x as long). Other than float32 it runs with "
                            "exact verification (generation/exact.py), float32 on a CPU with packed linears "
                            "(generation/packed.py); plain decoding with the stock kernels (and in float32) is measured "
                            "beside it")
    bench.add_argument("--drafter-dtype", default="auto", choices=("auto", *DTYPES),
                       help="drafters' dtype, at batch 1 and in the engine; auto: bfloat16 beside a float32 target "
                            "on a CPU with bfloat16 units (drafting reads half the bytes: 3.5%% faster MTP generation "
                            "measured at batch 1, 3-5%% more engine throughput at concurrency 4), else the target's")
    bench.add_argument("--stock-kernels", action="store_true",
                       help="do not install our verification kernels: exact verification in bfloat16 (whose output then "
                            "differs from plain decoding), packed linears in float32 on CPUs (verify forwards then cost "
                            "up to twice a plain step on CPUs whose BLAS re-packs weights for a few rows)")
    bench.add_argument("--engine-dtype", default="float32", choices=DTYPES,
                       help="the batched engine's target dtype (its padded batches are exact in float32)")
    bench.add_argument("--engine-threads", type=int, default=0, help="torch threads for the engine (0: torch's default)")
    bench.add_argument("--no-dcut", action="store_true", help="skip the D-cut rows (and the cost profile)")
    bench.add_argument("--concurrency", type=int, nargs="*", default=[4, 16],
                       help="engine concurrency levels to measure (none with --quick); each starts with a control "
                            "pair, plain batched decoding beside itself, whose ratio shows the pairing's own noise")
    bench.add_argument("--engine-repeats", type=int, default=1,
                       help="passes per engine configuration, each served step by step in turn with a pass of "
                            "plain batched decoding; rows report the median (on a shared machine plain batched "
                            "decoding alone moves by about 10%% between passes)")
    bench.set_defaults(handler=run_bench)

    push = commands.add_parser("push", help="upload a saved drafter with its model card to the Hub")
    push.add_argument("directory")
    push.add_argument("repo_id")
    push.add_argument("--private", action="store_true", default=None)
    push.add_argument("--create-pr", action="store_true")
    push.set_defaults(handler=run_push)

    convert = commands.add_parser("convert", help="write a drafter in another project's format, or read one")
    convert.add_argument("--to", required=True,
                         choices=["dflash", "transformers-dflash", "eagle3", "angelspec", "angelspec-hf"],
                         help="dflash: a DFlash-mode block drafter as z-lab DFlashDraftModel; eagle3: an MTP drafter "
                              "as LlamaForCausalLMEagle3; angelspec: a DFly/DFlare drafter as AngelSpec's "
                              "Qwen3DFlyModel/DFlare, a deepseek-style MTP drafter as MTPDraftModel; transformers-dflash: a DFlash-mode drafter as transformers' "
                              "own assistant (speculation_type='dflash'); angelspec-hf: read any of these")
    convert.add_argument("--block-size", type=int, default=None,
                         help="block size of an AngelSpec checkpoint whose config does not record it")
    convert.add_argument("--target", default=None,
                         help="target (reference, a directory or Hub id): needed to read EAGLE-3 and MTPDraftModel "
                              "and to write full-vocabulary MTP drafters as EAGLE-3 or MTPDraftModel")
    convert.add_argument("source")
    convert.add_argument("destination")
    convert.set_defaults(handler=run_convert)

    profile = commands.add_parser("profile", help="measure the target's forward cost on this hardware for D-cut")
    profile.add_argument("--target", default="reference")
    profile.add_argument("--threads", type=int, default=0,
                         help="torch threads (0: torch's default); profiles are kept per thread count (bench "
                              "prices batch 1 at --threads, 1 by default, and the engine at torch's default)")
    profile.add_argument("--dtype", default="float32", choices=DTYPES)
    profile.add_argument("--stock-kernels", action="store_true",
                         help="profile the target's own kernels, as `bench --stock-kernels` runs it (default: "
                              "packed linears in float32, exact verification in bfloat16, as bench and the engine)")
    profile.set_defaults(handler=run_profile)

    rollouts = commands.add_parser("rollouts", help="greedy target responses to the training split of prompt sets")
    rollouts.add_argument("--target", default="reference")
    rollouts.add_argument("--prompts", nargs="*", default=["gsm8k", "humaneval", "mbpp"],
                          help="bundled sets (mtbench, humaneval, mbpp, gsm8k) or JSONL files; none after the flag "
                               "answers only the --magpie prompts")
    rollouts.add_argument("--output-dir", default="data/rollouts/SmolLM2-135M-Instruct")
    rollouts.add_argument("--max-new-tokens", type=int, default=192)
    rollouts.add_argument("--batch-size", type=int, default=16)
    rollouts.add_argument("--dtype", default="float32", choices=DTYPES,
                          help="decoding dtype. bfloat16 is faster on a GPU and on a CPU with AMX (measured on the reference target "
                               "at 64 rows, two threads: 1.6x float32, 2.1x padded generate at 16 rows), "
                               "and the rows stay the target's own answers (its greedy path in bfloat16 arithmetic, "
                               "which can part from float32's after a near-tie); soft labels and target states are "
                               "recomputed in float32 when training. Use batches of 32-64 there")
    rollouts.add_argument("--magpie", type=int, default=0,
                          help="also answer Magpie-style chat prompts sampled from the target until the output's prompt list "
                               "(../prompts/<output-dir name>-magpie.jsonl) holds this many; it grows from run to run")
    rollouts.add_argument("--magpie-opening", default="",
                          help="start every synthesised user turn with this text, e.g. \"Write a Python function that\", "
                               "to steer the prompts to a domain. Several openings can share an --output-dir (its prompt list "
                               "grows run by run), but keep one --output-dir per --magpie-domain: the list's rows are "
                               "rewritten with the current run's domain")
    rollouts.add_argument("--magpie-domain", default="chat", help="the domain recorded on the Magpie rows")
    rollouts.add_argument("--magpie-turn-tokens", type=int, default=64,
                          help="longest synthesised user turn; longer ones are cut off and dropped, so raise it for "
                               "long multi-part requests (the steered code runs kept about one draw in five at 64)")
    from .training.recipes import RECIPES, Recipe

    rollouts.add_argument("--feature-cache", default=None,
                          help="keep the target's states of every rollout row there while decoding (no second pass), "
                               "for `train --feature-cache`")
    rollouts.add_argument("--recipe", nargs="+", choices=sorted(RECIPES), default=["dfly-code"],
                          help="the recipes whose drafter layers the feature cache keeps")
    rollouts.add_argument("--target-layers", type=layer_list, default=None,
                          help="the layers the feature cache keeps instead of the recipes' defaults (as `train --target-layers`)")
    rollouts.add_argument("--rollout-length", type=int, default=448, help="as `train --rollout-length`")
    rollouts.set_defaults(handler=run_rollouts)

    corpus = commands.add_parser("corpus", help="distillation rows from existing text (code, math, chat, files)")
    corpus.add_argument("--target", default="reference")
    corpus.add_argument("--source", nargs="+", default=["code", "math", "chat"],
                        help="code (standard-library source), math (generated worked problems), chat (package "
                             "documentation prose and the chat training prompts), or text files / directories")
    corpus.add_argument("--tokens", type=int, default=200_000, help="trained tokens per source")
    corpus.add_argument("--seq-len", type=int, default=320)
    corpus.add_argument("--root", default=None, help="source tree for --source code (default: the standard library)")
    corpus.add_argument("--chat-prompts", nargs="*", default=[],
                        help="JSONL prompt files also read as user turns (e.g. the synthesised Magpie prompts)")
    corpus.add_argument("--output-dir", default="data/corpus/SmolLM2-135M-Instruct")
    corpus.add_argument("--seed", type=int, default=0)
    corpus.add_argument("--feature-cache", default=None,
                        help="also run the target over the rows now and keep its states there for `train --feature-cache`")
    corpus.add_argument("--recipe", nargs="+", choices=sorted(RECIPES), default=["dfly-code"],
                        help="the recipes whose drafter layers the feature cache keeps (one pass over the rows each)")
    corpus.add_argument("--target-layers", type=layer_list, default=None,
                        help="the layers the feature cache keeps instead of the recipes' defaults (as `train --target-layers`)")
    corpus.add_argument("--rollout-length", type=int, default=448, help="as `train --rollout-length`")
    corpus.add_argument("--batch-size", type=int, default=8)
    corpus.set_defaults(handler=run_corpus)

    defaults = Recipe()
    train = commands.add_parser("train", help="train a drafter (DFly, DFlash, DFlare or MTP) for a target")
    train.add_argument("--recipe", choices=sorted(RECIPES), default="dfly-code")
    train.add_argument("--target", default="reference")
    train.add_argument("--data", nargs="+", help="rollout and corpus JSONL files, or directories of them (see `rollouts`, `corpus`)")
    train.add_argument("--corpus-tokens", type=int, default=None,
                       help="tokens of framed standard-library code (default: 400k for block recipes, 0 for MTP)")
    train.add_argument("--draft-tokens", type=int, default=defaults.num_draft_tokens, help="MTP draft/TTT depth")
    train.add_argument("--draft-vocab-size", type=int, default=None, help="reduced draft vocabulary size (the most frequent tokens of the data)")
    train.add_argument("--corpus-length", type=int, default=320)
    train.add_argument("--rollout-length", type=int, default=448)
    train.add_argument("--output", required=True)
    train.add_argument("--block-size", type=int, default=defaults.block_size)
    train.add_argument("--layers", type=int, default=None,
                       help="decoder layers of a new drafter (default: 2 for block recipes, 1 for MTP recipes)")
    train.add_argument("--lk-steps", type=int, default=defaults.lk_steps)
    train.add_argument("--tv-steps", type=int, default=defaults.tv_steps)
    train.add_argument("--batch-size", type=int, default=defaults.batch_size)
    train.add_argument("--anchors", type=int, default=defaults.num_anchors)
    train.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    train.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                       help="AdamW's decoupled weight decay (default 0)")
    train.add_argument("--target-layers", type=layer_list, default=None,
                       help="comma-separated target decoder layers the drafter reads, e.g. 1,8,14,20,27 (default: the "
                            "recipe's: 3 spread layers for MTP, 5 for block drafters); with --from, an MTP drafter's "
                            "fusion is rewired to them (each old layer's weights to the nearest new layer, new ones "
                            "start at zero), a block drafter is refused")
    train.add_argument("--seed", type=int, default=defaults.seed)
    train.add_argument("--resume", action="store_true", help="continue from the last Trainer checkpoint")
    train.add_argument("--from", dest="from_drafter", default=None,
                       help="continue this trained drafter (directory or Hub id) instead of starting a new one; "
                            "it keeps its own layers and draft vocabulary")
    train.add_argument("--grow-layers", type=int, default=None,
                       help="with --from: first append draft layers up to this many, each starting as the identity "
                            "(block drafters: a copy of the last layer; MTP: a plain decoder layer made from the last "
                            "one; output projections zeroed), so the drafter starts from what it drafts now with more "
                            "capacity")
    train.add_argument("--bf16", action="store_true",
                       help="mixed precision: the drafter's matmuls in bfloat16 (GPUs, and CPUs with AMX: 1.4-1.6x faster "
                            "steps measured; on AVX2-only CPUs about 10x slower, with a warning); weights, losses and "
                            "the target's soft labels stay float32")
    train.add_argument("--feature-cache", default=None,
                       help="directory that keeps the target's states per training row, so each row runs through "
                            "the target once across epochs, stages and runs (float16: (layers read + 1) x hidden size x 2 bytes "
                            "per token, 4.6 kB for an MTP drafter of the reference target)")
    train.add_argument("--eval-per-set", type=int, default=4,
                       help="held-out prompts per set measured at the end and written into the model card (0: skip)")
    train.set_defaults(handler=run_train)

    vocab = commands.add_parser("draft-vocab", help="limit a trained DFly drafter to the most frequent tokens (faster drafting)")
    vocab.add_argument("drafter", help="drafter directory, rewritten in place")
    vocab.add_argument("--target", default="reference")
    vocab.add_argument("--data", nargs="*", default=["data/rollouts/SmolLM2-135M-Instruct", "data/rollouts/SmolLM2-135M-Instruct-chat"],
                       help="directories of rollout JSONL files whose response tokens are counted")
    vocab.add_argument("--corpus-tokens", type=int, default=400_000, help="tokens of framed standard-library code also counted")
    vocab.add_argument("--rollout-length", type=int, default=448)
    vocab.add_argument("--size", type=int, default=8192,
                       help="draft vocabulary size; below the drafter's own, the most frequent of its own tokens are kept")
    vocab.set_defaults(handler=run_draft_vocab)

    evaluate = commands.add_parser("eval", help="tau per domain through generate, greedy, with an identity check")
    evaluate.add_argument("--drafter", required=True)
    evaluate.add_argument("--target", default="reference")
    # Every domain by default: with --card the card holds what was measured, and an MTP drafter evaluated
    # on the old default (code and math) lost its chat row, the domain it is trained for.
    evaluate.add_argument("--domains", nargs="+", default=["chat", "code", "math"], choices=["chat", "code", "math"])
    evaluate.add_argument("--prompts", nargs="+", metavar="FILE",
                          help='JSONL prompt files (one {"prompt": ...} a line) to measure instead of the bundled sets, '
                               "each a domain named after the file: its held-out rows (1, 5, 9, ...: those that "
                               "`rollouts --prompts FILE` leaves out of training)")
    evaluate.add_argument("--per-set", type=int, default=8,
                          help="held-out prompts per prompt set (or of each --prompts file)")
    evaluate.add_argument("--max-new-tokens", type=int, default=128)
    evaluate.add_argument("--report", default="reports/eval.json")
    evaluate.add_argument("--dtype", default="float32", choices=DTYPES,
                          help="target and drafter dtype; other than float32 with exact verification (generation/exact.py)")
    evaluate.add_argument("--card", action="store_true",
                          help="also write the numbers (angelspec_results.json) and a model card into the drafter directory")
    evaluate.set_defaults(handler=run_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
