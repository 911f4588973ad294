"""The benchmark's bookkeeping on a tiny target: every method runs, is compared, and is reported."""

import copy
import json
import statistics

import pytest
import torch

from angelspec_hf.benchmark import (
    AR,
    CONTROL,
    PROMPT_LOOKUP,
    ROUTER,
    _median_run,
    format_table,
    run_benchmark,
    summarise,
    write_chart,
    write_report,
)
from angelspec_hf.generation import CostModel
from fitting import tiny_tokenizer

COST = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 512], seconds=[[1.0, 1.0], [1.4, 1.4]])


def test_benchmark_reports_every_method_and_domain(targets, tmp_path):
    target = targets.target("llama")
    drafters = {"mtp": targets.fitted("llama", "mtp"), "dfly": targets.fitted("llama", "dfly-hybrid-corr")}
    runs = run_benchmark(target, tiny_tokenizer(), drafters, ["code", "math"], per_set=1, max_new_tokens=12,
                         cost_model=COST)
    assert len(runs) == 6 * 3  # (AR, lookup, 2 drafters with and without D-cut) x (humaneval, mbpp, gsm8k)
    rows = summarise(runs)
    methods = (AR, PROMPT_LOOKUP, "mtp", "mtp + D-cut", "dfly", "dfly + D-cut")
    assert {(r["method"], r["domain"]) for r in rows} == {(m, d) for m in methods for d in ("code", "math")}
    assert not any(hasattr(d, "draft_policy") for d in drafters.values()), "D-cut is installed per run only"
    assert all(row["lossless"] for row in rows)
    ar_rows = [r for r in rows if r["method"] == AR]
    assert all(abs(r["speedup"] - 1.0) < 1e-9 and r["tau"] is None for r in ar_rows)
    assert all(r["tau"] is not None and r["tau"] >= 1.0 for r in rows if r["method"] in methods[2:])
    table = format_table(rows)
    assert "prompt lookup" in table and "NO" not in table
    write_report(runs, rows, tmp_path / "bench.json", {"batch_size": 1})
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["summary"] == rows and len(report["runs"]) == 18
    assert write_chart(rows, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_lossy_method_is_flagged(targets):
    target = targets.target("llama")
    runs = run_benchmark(target, tiny_tokenizer(), {}, ["math"], per_set=1, max_new_tokens=6)
    runs[1].identical = False  # as if prompt lookup had changed the output
    rows = summarise(runs)
    assert [r["lossless"] for r in rows] == [True, False]
    assert "NO" in format_table(rows)


def test_baselines_on_another_target_are_compared_with_that_targets_own_output(targets):
    """A plain-decoding row on a bfloat16 copy is its own reference, and the engine's references
    come from the target asked for, not from the benchmark's."""
    import copy

    import torch

    from angelspec_hf.benchmark import Method
    from angelspec_hf.generation.exact import make_verification_exact

    reference_target, tokenizer = targets.target("llama"), tiny_tokenizer()
    target = make_verification_exact(copy.deepcopy(reference_target).to(torch.bfloat16), max_rows=8).target
    baseline = Method("AR, float32", target=reference_target, threads=1)
    drafter = copy.deepcopy(targets.fitted("llama", "mtp")).to(torch.bfloat16)
    references: dict = {}
    threads = torch.get_num_threads()
    runs = run_benchmark(target, tokenizer, {"mtp": drafter}, ["math"], per_set=1, max_new_tokens=10,
                         references=references, baselines=[baseline], reference_target=reference_target)
    assert torch.get_num_threads() == threads
    rows = summarise(runs)
    assert [r["method"] for r in rows] == [AR, "AR, float32", PROMPT_LOOKUP, "mtp"]
    assert all(row["lossless"] for row in rows)
    # Speedups are against the faster of the two plain decodings of each prompt.
    plain = {r["method"]: r["speedup"] for r in rows if r["method"] in (AR, "AR, float32")}
    assert max(plain.values()) == 1.0 and min(plain.values()) <= 1.0
    prompt = next(r for r in runs if r.method == AR)
    from angelspec_hf.benchmark import benchmark_prompts
    from angelspec_hf.evaluation import chat_inputs

    text = benchmark_prompts(["math"], 1)[prompt.prompt_index][2]
    expected = reference_target.generate(**chat_inputs(tokenizer, text), max_new_tokens=10, do_sample=False)[0].tolist()
    assert references[text] == expected


def test_concurrency_rows_compare_the_engine_with_batch_one_outputs(targets, tmp_path):
    from angelspec_hf.benchmark import benchmark_prompts, run_concurrency

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    drafters = {"dfly": targets.fitted("llama", "dfly-hybrid-corr"), "mtp": targets.fitted("llama", "mtp")}
    references: dict = {}
    run_benchmark(target, tokenizer, drafters, ["code", "math"], per_set=1, max_new_tokens=10, references=references)
    cost = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 512], batch_sizes=[1, 2],
                     seconds=[[[1.0, 1.0], [1.4, 1.4]], [[1.2, 1.2], [2.0, 2.0]]])
    rows = run_concurrency(target, tokenizer, drafters, ["code", "math"], per_set=1, max_new_tokens=10, levels=[1, 2],
                           references=references, cost_model=cost)
    methods = [AR, CONTROL, "dfly", "dfly + D-cut", "mtp", "mtp + D-cut", ROUTER]
    assert [(r["method"], r["concurrency"]) for r in rows] == [(m, level) for level in (1, 2) for m in methods]
    assert rows[0]["speedup"] == 1.0 and rows[0]["tau"] is None and rows[2]["tau"] >= 1.0
    assert rows[3]["drafting_steps"] > 0 and set(rows[6]["drafters_chosen"]) <= {"dfly", "mtp", "none"}
    # The control pairs plain decoding with itself: no drafts, no policy, identical outputs.
    control = rows[1]
    assert control["tau"] is None and control["drafting_steps"] is None and control["drafters_chosen"] is None
    assert control["lossless"] and len(control["speedups"]) == 1 and control["speedup"] > 0
    assert "concur" in format_table(rows, group="concurrency")
    assert all(r["lossless"] for r in rows)
    # Concurrency 2 serves two requests a slot: the three batch-1 prompts and one more of each set,
    # whose references plain generate adds.
    assert [r["prompts"] for r in rows] == [3] * len(methods) + [6] * len(methods)
    assert len(references) == 6
    # Each configuration (and the control) ran beside an AR pass of its own; the AR row reports the
    # median and spread of them all.
    ar_row = rows[0]
    assert ar_row["ar_runs"] == len(methods) - 1 and ar_row["ar_spread"][0] <= ar_row["tokens_per_s"] <= ar_row["ar_spread"][1]
    assert all(r["speedup"] > 0 for r in rows[1:])
    assert write_chart(summarise(run_benchmark(target, tokenizer, drafters, ["math"], per_set=1, max_new_tokens=4)),
                       tmp_path / "both.png", rows)
    # Repeated passes: every configuration measured twice, the row keeps the median and both ratios.
    twice = run_concurrency(target, tokenizer, {"mtp": drafters["mtp"]}, ["math"], per_set=1, max_new_tokens=6,
                            levels=[2], references=references, repeats=2)
    assert twice[0]["ar_runs"] == 4 and len(twice[1]["speedups"]) == 2 and len(twice[2]["speedups"]) == 2
    assert twice[2]["speedup"] == statistics.median(twice[2]["speedups"])
    # A wrong reference is reported as lossy.
    references[benchmark_prompts(["math"], 1)[0][2]] = [0]
    broken = run_concurrency(target, tokenizer, {}, ["math"], per_set=2, max_new_tokens=10, levels=[2],
                             references=references)
    assert broken[0]["lossless"] is False


def test_control_pair_runs_plain_decoding_beside_itself(targets, monkeypatch):
    """The noise control: two plain engines served in turn, each lossless and timed on its own steps;
    asking for a control with a drafter is refused, naming the fix."""
    from angelspec_hf.benchmark import paired_engine_runs
    from angelspec_hf.generation import SpeculativeEngine

    target = targets.target("llama")
    ids = [[5, 9, 13, 2], [7, 7, 3]]
    expected = [plain_greedy(target, prompt, 8) for prompt in ids]
    engines = []
    init = SpeculativeEngine.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(SpeculativeEngine, "__init__", recorded)
    first, second = paired_engine_runs(target, None, None, 2, ids, 8, None, expected, control=True)
    assert len(engines) == 2 and not any(engine.drafters for engine in engines)
    assert first["lossless"] and second is not None and second["lossless"]
    assert first["tau"] is None and second["tau"] is None and second["tokens_per_s"] > 0
    assert paired_engine_runs(target, None, None, 2, ids, 8, None, expected)[1] is None
    with pytest.raises(ValueError, match="drafter=None"):
        paired_engine_runs(target, targets.fitted("llama", "mtp"), None, 2, ids, 8, None, expected, control=True)


def test_engine_prompts_keep_two_requests_a_slot_and_start_with_the_batch_one_prompts():
    from angelspec_hf.benchmark import benchmark_prompts, engine_prompts

    batch_one = benchmark_prompts(["chat", "code", "math"], 3)
    assert engine_prompts(["chat", "code", "math"], 3, 4) == batch_one
    at_16 = engine_prompts(["chat", "code", "math"], 3, 16)
    assert len(at_16) == 32 and len({prompt for _, _, prompt in at_16}) == 32
    assert {prompt for _, _, prompt in batch_one} <= {prompt for _, _, prompt in at_16}
    assert len(engine_prompts(["math"], 1, 3)) == 6


def test_paired_engine_runs_take_turns_by_time_spent(targets, monkeypatch):
    """AR and the drafter's engine share the machine step by step: whichever has spent less time
    steps next, so neither runs alone while the other still has work, and each is timed on its
    own steps only. The benchmark's clock is a fake one that each step advances (a drafting step
    by two units, a plain one by one), so the turns do not depend on the machine's timing."""
    from types import SimpleNamespace

    from angelspec_hf import benchmark
    from angelspec_hf.benchmark import paired_engine_runs
    from angelspec_hf.generation import SpeculativeEngine

    target = targets.target("llama")
    drafter = targets.fitted("llama", "dfly-hybrid-corr")
    ids = [[5, 9, 13, 2], [7, 7, 3], [11, 4, 6, 8, 2]]
    expected = [plain_greedy(target, prompt, 12) for prompt in ids]
    turns = []
    clock = [0.0]
    step = SpeculativeEngine.step

    def recorded(engine):
        turns.append("spec" if engine.drafters else "ar")
        clock[0] += 2.0 if engine.drafters else 1.0  # a drafting step costs two of the other's
        return step(engine)

    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(SpeculativeEngine, "step", recorded)
    ar, spec = paired_engine_runs(target, drafter, None, 2, ids, 12, None, expected)
    assert ar["lossless"] and spec["lossless"] and spec["tau"] > 1.0 and ar["tau"] is None
    last_spec = max(i for i, who in enumerate(turns) if who == "spec")
    last_ar = max(i for i, who in enumerate(turns) if who == "ar")
    overlap = turns[: min(last_spec, last_ar) + 1]
    # Equal time while both run: about two AR steps per drafting step, never a long run of one.
    assert 1.4 < overlap.count("ar") / overlap.count("spec") < 2.6, turns
    assert "spec, spec" not in ", ".join(overlap) and "ar, ar, ar, ar" not in ", ".join(overlap), turns
    # Each engine's throughput counts its own steps' time only.
    new_tokens = len(ids) * 12
    assert ar["tokens_per_s"] == pytest.approx(new_tokens / turns.count("ar"))
    assert spec["tokens_per_s"] == pytest.approx(new_tokens / (2.0 * turns.count("spec")))


def plain_greedy(target, prompt: list[int], new_tokens: int) -> list[int]:
    return target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0].tolist()


def test_a_dflash_drafter_also_runs_through_transformers_own_dflash_path(targets):
    """The benchmark runs a DFlash-mode drafter through transformers' own path too, checked exact,
    with tau from the target's counted forwards. That the two paths draft alike is checked in
    test_interop_dflash, on text the tiny drafter drafts well: on these two prompts it accepts a
    token or two in all, so a single draft token decides a comparison of tau (on an Intel Xeon with
    AMX, session 59, with the tiny drafter fitted there: 1.16 against 1.0, in float64 too)."""
    target = targets.target("llama")
    drafters = {"dflash": targets.fitted("llama", "dfly-global-nocorr")}
    rows = summarise(run_benchmark(target, tiny_tokenizer(), drafters, ["math"], per_set=2, max_new_tokens=12))
    by_method = {row["method"]: row for row in rows}
    native = by_method["dflash via transformers' DFlash"]
    assert native["lossless"] and native["tau"] is not None and 1.0 <= native["tau"] <= 8.0
    assert by_method["dflash"]["lossless"]


def test_repeated_engine_runs_report_median_drafting_steps_and_every_chosen_drafter():
    def run(rate, steps, chosen):
        return {"prompts": 2, "tokens_per_s": rate, "speedup": rate / 10, "tau": 1.2, "lossless": True,
                "drafting_steps": steps, "drafters_chosen": chosen}

    row = _median_run([run(9, 4, ["mtp"]), run(12, 8, ["none"]), run(10, 6, ["mtp", "dfly"])])
    assert row["tokens_per_s"] == 10 and row["speedups"] == [0.9, 1.2, 1.0]
    assert row["drafting_steps"] == 6 and row["drafters_chosen"] == ["dfly", "mtp", "none"]
    plain = _median_run([run(9, None, None), run(11, None, None)])
    assert plain["drafting_steps"] is None and plain["drafters_chosen"] is None


@pytest.mark.parametrize("bf16_ms,expected", [([120.0] * 3, "float32"), ([80.0] * 3, "bfloat16"),
                                              ([94.0] * 3, "bfloat16"), ([96.0] * 3, "float32"),
                                              ([100.0] * 3, "float32"), ([60.0, 99.0, 98.0], "float32"),
                                              ([90.0, 90.0, 300.0], "bfloat16")])
def test_bench_picks_the_dtype_this_hardware_verifies_faster(targets, monkeypatch, bf16_ms, expected):
    """`bench --dtype auto` times both dtypes turn by turn (bfloat16 with exact kernels, float32 with
    packed linears where oneDNN has them) and verifies in the faster one: on an AVX2-only CPU
    bfloat16 verification took 2.3x float32's. bfloat16 must be faster by 5%, what its exact kernels
    cost plain decoding, in the median round: one lucky or slow round does not decide."""
    from angelspec_hf import cli, generation
    from angelspec_hf.generation.exact import is_verification_exact
    from angelspec_hf.generation.packed import is_packed, packing_available

    def load(name, dtype="float32"):
        return copy.deepcopy(targets.target("llama")).to(getattr(torch, dtype))

    timed = []

    def interleaved(models, new_tokens, context, rounds):
        timed.append({name: (m.dtype, is_verification_exact(m), is_packed(m)) for name, m in models.items()})
        assert (new_tokens, context) == (9, 256)
        return {"float32": [0.1] * len(bf16_ms), "bfloat16": [ms / 1000 for ms in bf16_ms]}

    monkeypatch.setattr(cli, "load_target_model", load)
    monkeypatch.setattr(generation, "interleaved_verify_seconds", interleaved)
    dtype, verify_ms = cli.faster_verification_dtype("tiny", threads=1)
    assert dtype == expected
    assert verify_ms == pytest.approx({"float32": 100.0, "bfloat16": sorted(bf16_ms)[1]})
    assert timed == [{"float32": (torch.float32, False, packing_available()), "bfloat16": (torch.bfloat16, True, False)}]
    assert cli.build_parser().parse_args(["bench"]).dtype == "auto"


def test_a_target_bfloat16_cannot_verify_exactly_is_benchmarked_in_float32(monkeypatch, caplog):
    """`bench` on a target whose attention the exact kernels refuse (Gemma 2's soft-capping, GPT-OSS's
    sinks) stopped with ExactVerificationError while choosing its batch-1 dtype."""
    from angelspec_hf import cli, generation
    from angelspec_hf.reference import tiny_target

    monkeypatch.setattr(cli, "load_target_model", lambda name, dtype="float32": tiny_target("gemma2").to(getattr(torch, dtype)))
    monkeypatch.setattr(generation, "interleaved_verify_seconds", lambda *a, **k: pytest.fail("nothing to compare"))
    with caplog.at_level("WARNING"):
        assert cli.faster_verification_dtype("tiny-gemma2", threads=1) == ("float32", {})
    assert "bfloat16 cannot verify drafts exactly on tiny-gemma2" in caplog.text and "softcap" in caplog.text


def test_interleaved_verify_seconds_times_the_targets_turn_by_turn(targets):
    """Each round times every target once, the order reversed each round, so that a slow spell on
    the host lands on both dtypes rather than on whichever was measured during it; each timing is a
    forward of the asked new tokens over a cache of the asked context, left as it was found."""
    from angelspec_hf.generation import interleaved_verify_seconds

    models = {"a": copy.deepcopy(targets.target("llama")), "b": copy.deepcopy(targets.target("llama"))}
    calls = []
    for name, model in models.items():
        model.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: calls.append(
                (name, kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1],
                 kwargs["past_key_values"].get_seq_length())), with_kwargs=True)
    seconds = interleaved_verify_seconds(models, new_tokens=3, context=20, rounds=4)
    assert {name: len(times) for name, times in seconds.items()} == {"a": 4, "b": 4}
    assert all(t > 0 for times in seconds.values() for t in times)
    # Per target: a prefill of the context and a warm-up, then the timed rounds a b, b a, a b, b a.
    assert calls[:4] == [("a", 20, 0), ("a", 3, 20), ("b", 20, 0), ("b", 3, 20)]
    assert [name for name, *_ in calls[4:]] == list("abbaabba")
    assert all(shape == [3, 20] for _, *shape in calls[4:])


def test_bench_installs_the_verification_kernels_of_the_target_dtype(targets):
    """Exact kernels in bfloat16 (token identity), packed linears in float32 on a CPU (speed), none
    with --stock-kernels; the bench copies the target for stock plain decoding only when it installs some."""
    from angelspec_hf import cli
    from angelspec_hf.generation.exact import is_verification_exact
    from angelspec_hf.generation.packed import is_packed, packing_available

    float32 = copy.deepcopy(targets.target("llama"))
    bfloat16 = copy.deepcopy(targets.target("llama")).to(torch.bfloat16)
    assert cli.verification_kernels(float32, stock=True) == cli.verification_kernels(bfloat16, stock=True) == "stock"
    assert cli.install_verification_kernels(bfloat16) == "exact" and is_verification_exact(bfloat16)
    expected = "packed" if packing_available() else "stock"
    assert cli.install_verification_kernels(float32) == expected and is_packed(float32) == packing_available()


@pytest.mark.parametrize("bf16_units,float32_drafters", [(True, False), (False, True)])
def test_bench_drafts_in_bfloat16_beside_a_float32_target_only_where_the_cpu_has_bfloat16_units(
        targets, monkeypatch, bf16_units, float32_drafters):
    """`--drafter-dtype auto`: drafting is bound by reading the drafter's weights, so bfloat16 beside
    a float32 target on a CPU with bfloat16 units (3.5% faster MTP generation measured); elsewhere,
    where bfloat16 is emulated, the target's dtype. A bfloat16 target keeps bfloat16 drafters, an
    explicit choice wins, and drafters of either dtype keep the output token-identical."""
    from angelspec_hf import cli

    monkeypatch.setattr(cli, "cpu_has_bfloat16_units", lambda: bf16_units)
    target = targets.target("llama")
    expected = torch.float32 if float32_drafters else torch.bfloat16
    assert cli.drafter_dtype(target) == expected
    assert cli.drafter_dtype(copy.deepcopy(target).to(torch.bfloat16)) == torch.bfloat16
    assert cli.drafter_dtype(target, "float32") == torch.float32
    assert cli.build_parser().parse_args(["bench"]).drafter_dtype == "auto"
    kinds = ("mtp", "dfly-hybrid-corr", "dfly-global-nocorr")  # the last is DFlash: transformers' path too
    drafters = {kind: copy.deepcopy(targets.fitted("llama", kind)).to(expected).eval() for kind in kinds}
    rows = summarise(run_benchmark(target, tiny_tokenizer(), drafters, ["math"], per_set=2, max_new_tokens=12))
    assert "dfly-global-nocorr via transformers' DFlash" in {row["method"] for row in rows}
    assert all(row["lossless"] for row in rows)


def test_a_sampled_benchmark_seeds_every_method_alike_and_reports_speed_only(targets, monkeypatch):
    """With a temperature every method samples, each prompt from the same seed for every method, and
    the rows say their outputs were not compared (speculative sampling keeps the distribution, not the draws)."""
    target = targets.target("llama")
    drafters = {"dfly": targets.fitted("llama", "dfly-hybrid-corr")}
    calls = []
    generate = type(target).generate

    def recording(self, *args, **kwargs):
        calls.append((torch.initial_seed(), kwargs.get("do_sample"), kwargs.get("temperature")))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "generate", recording)
    runs = run_benchmark(target, tiny_tokenizer(), drafters, ["math"], per_set=2, max_new_tokens=10,
                         cost_model=COST, temperature=0.8, seed=40)
    measured = calls[1:]  # the first call is the greedy warm-up
    assert {(sample, temperature) for _, sample, temperature in measured} == {(True, 0.8)}
    methods = (AR, PROMPT_LOOKUP, "dfly", "dfly + D-cut")
    assert [seed for seed, *_ in measured] == [40] * len(methods) + [41] * len(methods)
    assert all(run.identical is None for run in runs)
    rows = summarise(runs)
    assert {row["method"] for row in rows} == set(methods) and all(row["lossless"] is None for row in rows)
    assert all(line.endswith("sampled") for line in format_table(rows).splitlines()[2:])


def test_a_negative_temperature_is_refused():
    from angelspec_hf.benchmark import decoding_kwargs

    assert decoding_kwargs(0) == {"do_sample": False}
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        decoding_kwargs(-0.5)


def test_sampled_concurrency_rows_sample_every_request_and_report_speed_only(targets, monkeypatch):
    """With a temperature every engine request samples with the batch-1 settings (temperature and
    transformers' default top-k), and the rows say their outputs were not compared."""
    from angelspec_hf.benchmark import SAMPLING_TOP_K, run_concurrency
    from angelspec_hf.generation import SpeculativeEngine

    settings = []
    submit = SpeculativeEngine.submit

    def recording(self, prompt, *args, **kwargs):
        settings.append((kwargs.get("do_sample"), kwargs.get("temperature"), kwargs.get("top_k")))
        return submit(self, prompt, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "submit", recording)
    target = targets.target("llama")
    rows = run_concurrency(target, tiny_tokenizer(), {"dfly": targets.fitted("llama", "dfly-hybrid-corr")}, ["math"],
                           per_set=2, max_new_tokens=8, levels=[2], references={}, temperature=0.9, seed=3)
    assert settings and set(settings) == {(True, 0.9, SAMPLING_TOP_K)}
    assert [r["method"] for r in rows] == [AR, CONTROL, "dfly"] and all(r["lossless"] is None for r in rows)
    assert format_table(rows, group="concurrency").splitlines()[-1].endswith("sampled")


def test_sampled_repeats_draw_new_texts(targets, monkeypatch):
    """Each sampled repeat of a pair starts from its own seed, so the median averages over texts."""
    import angelspec_hf.benchmark as benchmark

    seeds = []
    paired = benchmark.paired_engine_runs

    def spy(*args, **kwargs):
        seeds.append(args[-1])
        return paired(*args, **kwargs)

    monkeypatch.setattr(benchmark, "paired_engine_runs", spy)
    benchmark.run_concurrency(targets.target("llama"), tiny_tokenizer(), {"dfly": targets.fitted("llama", "dfly-hybrid-corr")},
                              ["math"], per_set=1, max_new_tokens=6, levels=[2], references={}, temperature=0.9, seed=5,
                              repeats=2)
    assert seeds == [5, 5, 6, 6]  # the control pair and the drafter's, each repeat


def test_bench_measures_a_prompt_file_as_its_own_domain(targets, tmp_path, monkeypatch):
    """`bench --prompts FILE`: every prompt of the file (no held-out split), reported under the
    file's name, batch 1 and engine alike; a bad file or two files of one name stop the bench before
    anything loads, naming the option and the fix."""
    import json as json_module

    from angelspec_hf import cli
    from angelspec_hf.benchmark import benchmark_prompts, engine_prompts, run_concurrency

    mine = tmp_path / "support.jsonl"
    texts = [f"How do I reset password number {i}?" for i in range(5)]
    mine.write_text("".join(json_module.dumps({"prompt": text}) + "\n" for text in texts))
    assert benchmark_prompts([str(mine)], None) == [("support", i, text) for i, text in enumerate(texts)]
    assert [p for *_, p in benchmark_prompts([str(mine)], 2)] == texts[:2]
    assert len(engine_prompts([str(mine)], None, 16)) == 5  # a file gives what it has
    assert len(engine_prompts([str(mine)], 2, 2)) == 4

    target, tokenizer = targets.target("llama"), tiny_tokenizer()
    references: dict = {}
    rows = summarise(run_benchmark(target, tokenizer, {}, [str(mine)], per_set=2, max_new_tokens=6,
                                   references=references))
    assert {row["domain"] for row in rows} == {"support"} and rows[0]["prompts"] == 2
    engine_rows = run_concurrency(target, tokenizer, {}, [str(mine)], per_set=2, max_new_tokens=6, levels=[2],
                                  references=references)
    assert engine_rows[0]["prompts"] == 4 and engine_rows[0]["lossless"]

    args = cli.build_parser().parse_args(["bench", "--prompts", str(mine)])
    assert args.per_set is None and args.prompts == [str(mine)]
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("loaded a target before checking the prompts"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    with pytest.raises(SystemExit, match=r"--prompts: .*broken.jsonl, line 2: expected a JSON object with a \"prompt\""):
        cli.run_bench(cli.build_parser().parse_args(["bench", "--prompts", str(broken), "--dtype", "float32"]))
    broken.write_text('{"prompt": "fine"}\n\nnot json at all\n')
    with pytest.raises(SystemExit, match=r"--prompts: .*broken.jsonl, line 3: expected a JSON object"):
        cli.run_bench(cli.build_parser().parse_args(["bench", "--prompts", str(broken), "--dtype", "float32"]))
    with pytest.raises(SystemExit, match="--per-set: must be at least 1"):
        cli.run_bench(cli.build_parser().parse_args(["bench", "--prompts", str(mine), "--per-set", "0", "--dtype", "float32"]))
    with pytest.raises(SystemExit, match="--prompts: .*JSONL prompt file"):
        cli.run_bench(cli.build_parser().parse_args(["bench", "--prompts", str(tmp_path / "missing.jsonl"), "--dtype", "float32"]))
    other = tmp_path / "more"
    other.mkdir()
    (other / "support.jsonl").write_text(mine.read_text())
    with pytest.raises(SystemExit, match="share one"):
        cli.run_bench(cli.build_parser().parse_args(["bench", "--prompts", str(mine), str(other / "support.jsonl"),
                                                     "--dtype", "float32"]))


def test_chart_gives_a_method_one_colour_in_both_panels(tmp_path, monkeypatch):
    """A drafter reads alike at batch 1 and in the engine panel, though the panels list other methods."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    batch_one = [{"method": m, "domain": "code", "speedup": s} for m, s in ((AR, 1.0), (PROMPT_LOOKUP, 1.2), ("dfly", 2.0))]
    engine = [{"method": m, "concurrency": 4, "speedup": s} for m, s in ((AR, 1.0), ("dfly", 1.3), (ROUTER, 1.2))]
    assert write_chart(batch_one, tmp_path / "chart.png", engine, subtitle="greedy, tiny")
    left, right = figures[0].axes
    colours = [{label: tuple(bars.patches[0].get_facecolor()) for bars, label in zip(*ax.get_legend_handles_labels())}
               for ax in (left, right)]
    assert colours[0][AR] == colours[1][AR] and colours[0]["dfly"] == colours[1]["dfly"]
    assert colours[1][ROUTER] not in colours[0].values()
    assert left.get_title().endswith("greedy, tiny")
