"""D-cut and the cost model."""

import dataclasses
import itertools
import json
import logging
import platform
from pathlib import Path

import pytest
import torch

from angelspec_hf.generation import CostModel, DCutPolicy, FixedLengthPolicy, profile_target
from angelspec_hf.generation.dcut import (
    Calibrator,
    best_cut,
    best_window,
    step_progress,
    worth_extending,
)
from conftest import PROMPT_LENGTH


def linear_cost(base: float, per_token: float) -> CostModel:
    tokens = [1, 2, 4, 8, 16]
    return CostModel(target="synthetic", hardware="synthetic", tokens=tokens, contexts=[0, 4096],
                     seconds=[[base + per_token * (t - 1)] * 2 for t in tokens])


def brute_force(confidences, verify, sunk=0.0):
    def rate(k):
        expected = 1.0 + sum(torch.tensor(confidences[:j]).prod().item() for j in range(1, k + 1))
        return expected / (sunk + verify(k + 1))
    return max(range(len(confidences) + 1), key=rate)


@pytest.mark.parametrize("per_token", [0.0, 0.01, 0.05, 0.2, 1.0])
def test_best_cut_is_the_brute_force_optimum(per_token):
    model = linear_cost(0.1, per_token)
    verify = lambda n: model.verify_seconds(n, 100)  # noqa: E731
    generator = torch.Generator().manual_seed(int(per_token * 1000))
    for _ in range(50):
        confidences = torch.rand(7, generator=generator).tolist()
        assert best_cut(confidences, verify) == brute_force(confidences, verify)


@pytest.mark.parametrize("sunk", [0.02, 0.1, 0.5])
def test_best_cut_counts_the_rounds_drafting_time(sunk):
    """Drafting already spent still belongs to the round: the cut maximises tokens over drafting
    plus verification, which keeps longer drafts than pricing verification alone."""
    model = linear_cost(0.1, 0.03)
    verify = lambda n: model.verify_seconds(n, 100)  # noqa: E731
    generator = torch.Generator().manual_seed(11)
    for _ in range(50):
        confidences = torch.rand(7, generator=generator).tolist()
        assert best_cut(confidences, verify, sunk) == brute_force(confidences, verify, sunk)
    # 1 + 0.5 (n - 1): without drafting time k=1 wins (1.9/1.5 against 2.35/2.0); with 1 s of it
    # k=2 does (1.9/2.5 = 0.76 against 2.35/3.0 = 0.78).
    assert best_cut([0.9, 0.5], lambda n: 1 + 0.5 * (n - 1)) == 1
    assert best_cut([0.9, 0.5], lambda n: 1 + 0.5 * (n - 1), sunk_seconds=1.0) == 2


def test_best_cut_extremes_by_hand():
    free = lambda n: 1.0  # noqa: E731
    assert best_cut([0.9, 0.5, 0.1], free) == 3  # verification is free: keep everything
    expensive = lambda n: float(n)  # noqa: E731
    assert best_cut([0.9, 0.5, 0.1], expensive) == 0  # each token costs a full step: draft nothing
    # cost 1 + 0.5 (n - 1): k=1 gives 1.9/1.5 = 1.267, k=2 gives 2.35/2.0 = 1.175, k=0 gives 1.
    assert best_cut([0.9, 0.5], lambda n: 1 + 0.5 * (n - 1)) == 1


def test_cost_model_is_monotone_in_context_interpolates_and_round_trips(tmp_path, caplog):
    model = CostModel(target="t", hardware="elsewhere", tokens=[1, 4], contexts=[10, 100],
                      seconds=[[2.0, 1.0], [0.5, 4.0]])
    # More context never costs less; more tokens may (a CPU's kernels for few rows can be slower).
    assert model.seconds == [[[2.0, 2.0], [0.5, 4.0]]]  # batch 1 only
    assert model.verify_seconds(1, 55) == pytest.approx(2.0)
    assert model.verify_seconds(4, 1000) == pytest.approx(4.0)
    assert model.verify_seconds(2.5, 55) == pytest.approx((2.0 + 2.25) / 2)
    with caplog.at_level(logging.WARNING):
        loaded = CostModel.load(model.save(tmp_path / "profile.json"))
    assert loaded.seconds == model.seconds and "re-run `angelspec-hf profile`" in caplog.text


def test_profiles_are_keyed_by_the_cpu_model(tmp_path, monkeypatch, caplog):
    """Linux leaves `platform.processor()` empty, so the CPU's model name comes from /proc/cpuinfo:
    a profile measured on another CPU model is found under another name and warns if loaded."""
    from angelspec_hf.generation import cost_model

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  9454 48-Core Processor\n")
    monkeypatch.setattr(cost_model, "CPUINFO", cpuinfo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cost_model.cpu_model.cache_clear()
    try:
        assert cost_model.cpu_model() == "AMD EPYC 9454 48-Core Processor"
        here = cost_model.hardware_id()
        assert "AMD EPYC 9454" in here and "threads=" in here
        monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path / "home"))
        path = cost_model.profile_path("tiny")
        CostModel(target="tiny", hardware=here, tokens=[1, 2], contexts=[0, 8],
                  seconds=[[1.0, 1.0], [1.5, 1.5]]).save(path)
        cpuinfo.write_text("model name\t: Intel(R) Xeon(R) Platinum 8480+\n")
        cost_model.cpu_model.cache_clear()
        assert cost_model.profile_path("tiny") != path
        with caplog.at_level(logging.WARNING):
            CostModel.load(path)
        assert "Intel(R) Xeon(R) Platinum 8480+" in caplog.text and "re-run `angelspec-hf profile`" in caplog.text
        cpuinfo.unlink()
        cost_model.cpu_model.cache_clear()
        assert cost_model.cpu_model() == (platform.processor() or "unknown")
    finally:
        cost_model.cpu_model.cache_clear()
        cost_model.cpu_isa.cache_clear()


def test_profiles_are_keyed_by_the_cpu_instruction_set(tmp_path, monkeypatch, caplog):
    """Cloud VMs name different CPU generations alike ("AMD EPYC"); one with bfloat16 units and one
    without (where bfloat16 is emulated) get different profiles, and the other's profile warns."""
    from angelspec_hf.generation import cost_model

    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(cost_model, "CPUINFO", cpuinfo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path / "home"))

    def on(flags: str) -> tuple[str, Path]:
        cpuinfo.write_text(f"model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma {flags}\n")
        cost_model.cpu_model.cache_clear()
        cost_model.cpu_isa.cache_clear()
        return cost_model.hardware_id(), cost_model.profile_path("tiny")

    try:
        plain, plain_path = on("")
        with_units, units_path = on("avx512f avx512_bf16")
        assert cost_model.cpu_isa().endswith("+bf16") and not plain.split(":")[3].endswith("+bf16")
        assert units_path != plain_path and "AMD EPYC" in with_units
        assert on("avx512f avx512_bf16 amx_bf16 amx_tile")[0].split(":")[3].endswith("+amx+bf16")
        CostModel(target="tiny", hardware=plain, tokens=[1, 2], contexts=[0, 8],
                  seconds=[[1.0, 1.0], [1.5, 1.5]]).save(plain_path)
        on("avx512f avx512_bf16")
        with caplog.at_level(logging.WARNING):
            CostModel.load(plain_path)
        assert "+bf16" in caplog.text and "re-run `angelspec-hf profile`" in caplog.text
    finally:
        cost_model.cpu_model.cache_clear()
        cost_model.cpu_isa.cache_clear()


def test_profile_target_measures_the_grid(targets):
    model = profile_target(targets.target("llama"), "tiny", tokens=(1, 4), contexts=(8, 32), batch_sizes=(1, 3), repeats=2)
    assert model.batch_sizes == [1, 3]
    assert all(len(grid) == 2 and all(len(row) == 2 and all(v > 0 for v in row) for row in grid) for grid in model.seconds)


def test_profile_target_measures_contexts_past_a_sliding_window():
    """Cropping a sliding-window cache past its window raised RuntimeError in the profile's timed
    forwards, so D-cut could not start on Gemma 3 (window 512, contexts up to 768) or GPT-OSS (128)."""
    from angelspec_hf.reference import tiny_target

    model = profile_target(tiny_target("mistral", sliding_window=8), "tiny-window", tokens=(1, 4), contexts=(4, 32),
                           batch_sizes=(1, 2), repeats=1, sweeps=1)
    assert all(v > 0 for grid in model.seconds for row in grid for v in row)


def test_profile_timings_wait_for_the_device(targets, monkeypatch):
    """Each timed forward of a profile ends once the device has run it (a GPU runs kernels
    asynchronously): one wait per forward, warm-ups included, none for the prefills."""
    from angelspec_hf.generation import cost_model

    waits = []
    monkeypatch.setattr(cost_model, "wait_for_device", lambda device: waits.append(device))
    profile_target(targets.target("llama"), "tiny", tokens=(1, 2), contexts=(4,), batch_sizes=(1,), repeats=1, sweeps=1)
    assert waits == [torch.device("cpu")] * 4  # 2 points x (warm-up + 1 repeat)


def test_profile_target_survives_a_slow_spell(targets, monkeypatch):
    """A slow spell of the machine that covers one point's consecutive forwards must not price that
    point high: each point's timings come from separate sweeps over the grid (on a fake clock,
    every forward costs 1 ms per row and token; seven consecutive forwards cost 50x that)."""
    from angelspec_hf.generation import cost_model

    target = targets.target("llama")
    clock, calls = [0.0], [0]

    def forward_cost(module, args, kwargs, output):
        ids = args[0] if args else kwargs["input_ids"]
        calls[0] += 1
        clock[0] += 1e-3 * ids.numel() * (50 if 20 <= calls[0] < 27 else 1)

    handle = target.register_forward_hook(forward_cost, with_kwargs=True)
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    try:
        model = profile_target(target, "tiny", tokens=(1, 4), contexts=(8, 16), batch_sizes=(1, 2))
    finally:
        handle.remove()
    expected = [1e-3 * b * n for b in (1, 2) for n in (1, 4) for _ in (8, 16)]
    assert [v for table in model.seconds for row in table for v in row] == pytest.approx(expected)


def test_cost_model_batch_axis_interpolates_and_extrapolates():
    # 1 row: 1.0 s for 1 token, 2.0 for 4; 4 rows: twice that.
    model = CostModel(target="t", hardware="t", tokens=[1, 4], contexts=[0, 100], batch_sizes=[1, 4],
                      seconds=[[[1.0, 1.0], [2.0, 2.0]], [[2.0, 2.0], [4.0, 4.0]]])
    assert model.verify_seconds(4, 50, batch=1) == pytest.approx(2.0)
    assert model.verify_seconds(1, 50, batch=2.5) == pytest.approx(1.5)
    assert model.verify_seconds(4, 50, batch=8) == pytest.approx(8.0)  # linear beyond the grid
    with pytest.raises(ValueError, match="expected"):
        CostModel(target="t", hardware="t", tokens=[1, 4], contexts=[0], batch_sizes=[1, 4], seconds=[[[1.0], [2.0]]])


def test_slot_seconds_is_the_cheapest_slot_verify_seconds_gives_anywhere_on_the_grid():
    # Four rows of four tokens are the cheapest slot at short contexts, one row of four at long ones.
    model = CostModel(target="t", hardware="t", tokens=[1, 4], contexts=[0, 100, 200], batch_sizes=[1, 4],
                      seconds=[[[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], [[2.0, 2.0, 2.0], [4.0, 6.0, 12.0]]])
    for context in (0, 50, 100, 150, 200, 300):
        cheapest = min(model.verify_seconds(t, context, b) / (t * b) for t in (1, 4) for b in (1, 4))
        assert model.slot_seconds(context) == pytest.approx(cheapest, rel=1e-12), context
    assert model.slot_seconds(50) == pytest.approx(5.0 / 16) and model.slot_seconds(150) == pytest.approx(0.5)


def brute_force_window(survivals, verify, combine=sum):
    """Every combination of per-row draft lengths; a padded forward costs its widest window."""
    best, best_rate = None, -1.0
    for lengths in itertools.product(*(range(len(s) + 1) for s in survivals)):
        width = 1 + max(lengths)
        rate = combine(1 + sum(s[:k]) for s, k in zip(survivals, lengths)) / verify(width)
        if rate > best_rate + 1e-12:
            best, best_rate = width, rate
    return best, best_rate


@pytest.mark.parametrize("slowest_row", [False, True], ids=["summed", "slowest-row"])
@pytest.mark.parametrize("per_token", [0.0, 0.02, 0.1, 0.3, 1.0])
def test_best_window_is_the_brute_force_optimum_over_per_row_lengths(per_token, slowest_row):
    generator = torch.Generator().manual_seed(int(per_token * 100) + 1)
    verify = lambda width: 1.0 + per_token * (width - 1)  # noqa: E731
    combine = min if slowest_row else sum
    for _ in range(30):
        survivals = []
        for length in torch.randint(0, 5, (3,), generator=generator).tolist():
            survivals.append(torch.rand(length, generator=generator).cumprod(0).tolist())
        width = best_window(survivals, verify, slowest_row=slowest_row)
        _, optimum = brute_force_window(survivals, verify, combine)
        rate = combine(1 + sum(s[: width - 1]) for s in survivals) / verify(width)
        assert rate == pytest.approx(optimum)


def test_slowest_row_is_the_one_needing_the_most_steps():
    """With what rows have left, a row about to finish does not hold back one with far to go."""
    confident, hopeless = [0.9, 0.81, 0.729], []
    assert step_progress([confident, hopeless], 4, slowest_row=True) == 1.0  # least expected tokens
    # The draft-less row has 2 tokens left, the confident one 100: it is the one to speed up.
    assert step_progress([confident, hopeless], 4, True, remaining=[100, 2]) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    # The other way round the draft-less row needs 100 more steps whatever the width.
    assert step_progress([confident, hopeless], 4, True, remaining=[2, 100]) == pytest.approx(1.0)
    verify = lambda width: 1.0 + 0.1 * (width - 1)  # noqa: E731
    assert best_window([confident, hopeless], verify, slowest_row=True) == 1
    assert best_window([confident, hopeless], verify, slowest_row=True, remaining=[100, 2]) == 4
    with pytest.raises(ValueError, match="one per active row"):
        step_progress([confident, hopeless], 4, True, remaining=[100])


@pytest.mark.parametrize("remaining", [None, [5, 40, 40], [40, 3, 12]])
@pytest.mark.parametrize("sunk", [0.0, 0.3])
def test_best_window_with_drafting_time_and_what_rows_have_left_is_the_brute_force_optimum(sunk, remaining):
    generator = torch.Generator().manual_seed(5)
    verify = lambda width: 1.0 + 0.1 * (width - 1)  # noqa: E731
    for _ in range(30):
        survivals = [torch.rand(length, generator=generator).cumprod(0).tolist()
                     for length in torch.randint(0, 6, (3,), generator=generator).tolist()]
        longest = max(map(len, survivals))
        rates = {w: step_progress(survivals, w, True, remaining) / (sunk + verify(w)) for w in range(1, longest + 2)}
        width = best_window(survivals, verify, slowest_row=True, sunk_seconds=sunk, remaining=remaining)
        assert rates[width] == pytest.approx(max(rates.values()))


def test_batch_dcut_with_nothing_queued_drafts_for_the_slowest_row():
    """With requests waiting, one confident row pays for a wide window; with none waiting the run
    ends with its longest request, and a row that would accept nothing keeps the window at 1."""
    from angelspec_hf.generation import BatchDCutPolicy

    # Two rows: 8 slots cost 1.5 plain steps.
    model = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 100], batch_sizes=[1, 2],
                      seconds=[[[1.0, 1.0], [1.5, 1.5]], [[1.0, 1.0], [1.5, 1.5]]])
    policy = BatchDCutPolicy(model, explore_every=1000)
    rows = [[0.95] * 7, [0.01] * 7]
    assert policy.window(rows, batch=2, context=10, queued=True) == 8
    assert policy.window(rows, batch=2, context=10, queued=False) == 1
    assert policy.window([[0.95] * 7] * 2, batch=2, context=10, queued=False) == 8
    # The draft gate judges a step by the same measure, on what `window` expected of it (the
    # uncalibrated confidences' survivals here), not on what was accepted (9 tokens).
    assert policy.window(rows, batch=2, context=10, queued=True) == 8
    expected = 2 + sum(0.95 ** j for j in range(1, 8)) + sum(0.01 ** j for j in range(1, 8))
    policy.observe([(rows[0], 7), (rows[1], 0)], batch=2, width=8, context=10, draft_seconds=0.0, queued=True)
    assert policy.gate_for().efficiency == pytest.approx((expected / 1.5) / 2)
    # A step `window` did not see counts as accepted: the slowest row gained nothing here.
    policy.gate_for().efficiency = None
    policy.observe([(rows[0], 7), (rows[1], 0)], batch=2, width=8, context=10, draft_seconds=0.0, queued=False)
    assert policy.gate_for().efficiency == pytest.approx(1 / 1.5)


def test_policies_learn_drafting_time_and_count_it_in_the_cut():
    """Both policies keep a moving average of drafting time (per position at batch 1, per drafting
    row in the engine) and charge it to the round, so they cut less once drafting is known to cost."""
    from angelspec_hf.generation import BatchDCutPolicy

    # 1 + 0.5 (n - 1) seconds to verify n tokens: with nothing spent drafting one draft is best.
    model = CostModel(target="t", hardware="t", tokens=[1, 3], contexts=[0, 100], seconds=[[1.0, 1.0], [2.0, 2.0]])
    single = DCutPolicy(model, explore_every=1000)
    assert single.choose([0.9, 0.5], context=10) == 1
    single.observe([0.9], accepted=1, draft_seconds=1.0, context=10)  # 1 s for the 2 positions drafted
    assert single.position_seconds == pytest.approx(0.5)
    assert single.choose([0.9, 0.5], context=10) == 2  # 1.9 / 2.5 < 2.35 / 3.0

    batch = BatchDCutPolicy(model, explore_every=1000)
    assert batch.window([[0.9, 0.5]], batch=1, context=10) == 2  # the pending token and one draft
    batch.observe([([0.9], 1)], batch=1, width=2, context=10, draft_seconds=1.0)
    assert batch.gate_for().row_draft_seconds == pytest.approx(1.0)
    assert batch.window([[0.9, 0.5]], batch=1, context=10) == 3  # 1.9 / 2.5 < 2.35 / 3.0


def batch16_cost() -> CostModel:
    """At batch 16 a step verifying 8 slots per row costs 8 plain steps (compute-bound CPU)."""
    return CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 100], batch_sizes=[1, 16],
                     seconds=[[[1.0, 1.0], [1.2, 1.2]], [[2.0, 2.0], [16.0, 16.0]]])


def test_a_drafters_first_batch_step_waits_until_a_miss_is_cheap():
    from angelspec_hf.generation import BatchDCutPolicy

    # Batch 16 strictly compute-bound: one draft token a row costs more than two plain steps.
    steep = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 100], batch_sizes=[1, 16],
                      seconds=[[[1.0, 1.0], [1.2, 1.2]], [[2.0, 2.0], [20.0, 20.0]]])
    policy = BatchDCutPolicy(steep, explore_every=1000)
    assert policy.first_window(16, 10) == 1 and not policy.should_draft(16, 10, True, arm="a")
    assert policy.first_window(1, 10) > 8 and policy.should_draft(1, 10, True, arm="a")
    # Measured once (here at batch 1, where it paid), the drafter is gated as usual at any batch.
    policy.observe([([0.9] * 7, 7)], batch=1, width=8, context=10, draft_seconds=0.01, arms=["a"])
    assert policy.gate_for("a").paying and policy.should_draft(16, 10, True, arm="a")

    # Until measured, the window stops where it would cost two plain steps: a window of 4 here.
    mild = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 100], batch_sizes=[1, 16],
                     seconds=[[[1.0, 1.0], [1.2, 1.2]], [[2.0, 2.0], [6.0, 6.0]]])
    policy = BatchDCutPolicy(mild, explore_every=1000)
    certain = [[0.999] * 7] * 16
    assert policy.first_window(16, 10) == 4
    assert policy.window(certain, batch=16, context=10, arms=["a"] * 16) == 4
    policy.observe([(c, 7) for c in certain], batch=16, width=4, context=10, draft_seconds=0.01, arms=["a"] * 16)
    assert policy.window(certain, batch=16, context=10, arms=["a"] * 16) == 8


def test_a_drafters_first_batch_step_waits_where_a_good_drafter_would_only_break_even():
    from angelspec_hf.generation import BatchDCutPolicy
    from angelspec_hf.generation.dcut import CATCH_UP_SHARE, FIRST_STEP_ACCEPTANCE, FIRST_STEP_MIN_EFFICIENCY

    # Batch 16 like the reference CPU's: a window of 2 costs 1.4 plain steps (under the two of
    # `first_window`), each more token 0.35 more; batch 1 nearly flat.
    def cost(per_token: float) -> CostModel:
        return CostModel(target="t", hardware="t", tokens=[1, 2, 8], contexts=[0, 100], batch_sizes=[1, 16],
                         seconds=[[[1.0, 1.0], [1.05, 1.05], [1.2, 1.2]],
                                  [[2.0, 2.0], [2.8, 2.8], [2.8 + 6 * per_token, 2.8 + 6 * per_token]]])

    steep = BatchDCutPolicy(cost(0.7), explore_every=1000)
    assert steep.first_window(16, 10) == 3  # 2.8 and 3.5 seconds fit under 4, 4.2 does not
    # Brute force over the windows that fit: positions accepted at 0.7 each, over plain's 16 / 2.0.
    best = max((sum(FIRST_STEP_ACCEPTANCE ** j for j in range(w)) * 16 / seconds) / (16 / 2.0)
               for w, seconds in ((2, 2.8), (3, 3.5)))
    assert steep.first_step_efficiency(16, 10) == pytest.approx(best)
    assert best < FIRST_STEP_MIN_EFFICIENCY
    assert not steep.should_draft(16, 10, True, arm="a") and steep.should_draft(1, 10, True, arm="a")
    # Measured once, the drafter is gated as usual at any batch.
    steep.observe([([0.9] * 7, 7)], batch=1, width=8, context=10, draft_seconds=0.01, arms=["a"])
    assert steep.should_draft(16, 10, True, arm="a")

    # Where each more token costs little, the same first step pays and is taken.
    flat = BatchDCutPolicy(cost(0.05), explore_every=1000)
    assert flat.first_step_efficiency(16, 10) >= FIRST_STEP_MIN_EFFICIENCY
    assert flat.should_draft(16, 10, True, arm="a")
    # Unless its drafter must first read what it missed: the cheapest slot on the grid is 16 rows
    # of 8 tokens (3.1 s / 128), each missed position read at CATCH_UP_SHARE of it.
    assert flat.cost_model.slot_seconds(10) == pytest.approx(3.1 / 128)
    reading = 16 * 300 * CATCH_UP_SHARE * 3.1 / 128
    # (Windows past the grid's 8 tokens go on at its last step's 0.05 s a token.)
    best = max((sum(FIRST_STEP_ACCEPTANCE ** j for j in range(w)) * 16 / (reading + 2.8 + 0.05 * (w - 2)))
               / (16 / 2.0) for w in range(2, flat.first_window(16, 10) + 1))
    assert flat.first_step_efficiency(16, 10, catch_up=16 * 300) == pytest.approx(best)
    assert best < FIRST_STEP_MIN_EFFICIENCY <= flat.first_step_efficiency(16, 10, catch_up=16 * 5)
    assert not flat.should_draft(16, 10, True, arm="a", catch_up=16 * 300)
    assert flat.should_draft(16, 10, True, arm="a", catch_up=16 * 5)


def test_batch_dcut_drafts_less_as_the_batch_grows():
    from angelspec_hf.generation import BatchDCutPolicy

    # Like a CPU: a forward costs about the same for 1 to 8 slots at batch 1, but at batch 16
    # every slot costs what a decoded token does.
    policy = BatchDCutPolicy(batch16_cost(), explore_every=1000)
    confident = [0.9] * 7
    assert policy.window([confident], batch=1, context=10) == 8
    assert policy.window([confident] * 16, batch=16, context=10) == 1


def test_calibration_learns_that_confident_drafts_fail():
    calibrator = Calibrator()
    assert calibrator(0.95) == pytest.approx(0.95)
    for _ in range(200):
        calibrator.update(0.95, False)
    assert calibrator(0.95) < 0.05 and calibrator(0.35) == pytest.approx(0.35)


def test_policy_stops_drafting_when_it_does_not_pay_and_explores():
    policy = DCutPolicy(linear_cost(0.1, 0.05), explore_every=4, max_backoff=1)
    assert policy.should_draft()
    for _ in range(10):
        policy.observe([0.9, 0.9], accepted=0, draft_seconds=0.1, context=50)
    decisions = [policy.should_draft() for _ in range(8)]
    assert decisions == [False, False, False, True] * 2
    for _ in range(30):
        policy.observe([0.9, 0.9, 0.9], accepted=3, draft_seconds=0.01, context=50)
    assert policy.should_draft()


def test_retries_that_do_not_pay_back_off():
    policy = DCutPolicy(linear_cost(0.1, 0.05), explore_every=4, max_backoff=4)
    policy.observe([0.9, 0.9], accepted=0, draft_seconds=0.1, context=50)
    assert policy.gate.backoff == 2 and [policy.should_draft() for _ in range(8)] == [False] * 7 + [True]
    policy.observe([0.9, 0.9], accepted=0, draft_seconds=0.1, context=50)
    policy.observe([0.9, 0.9], accepted=0, draft_seconds=0.1, context=50)
    assert policy.gate.backoff == 4 and [policy.should_draft() for _ in range(16)] == [False] * 15 + [True]
    for _ in range(30):  # drafting pays again: back to the short wait, and drafting every round
        policy.observe([0.9, 0.9, 0.9], accepted=3, draft_seconds=0.01, context=50)
    assert policy.gate.backoff == 1 and policy.should_draft()


def test_batch1_gate_weighs_a_round_by_what_the_cut_expected():
    """A round that accepted nothing counts for its calibrated expectation, as in the engine."""
    policy = DCutPolicy(linear_cost(1.0, 0.0), explore_every=1000)
    assert policy.choose([0.9, 0.8], context=10) == 2  # verification is free: keep both
    policy.observe([0.9, 0.8], accepted=0, draft_seconds=0.0, context=10)
    assert policy.gate.efficiency == pytest.approx(1 + 0.9 + 0.9 * 0.8)
    # Without a `choose` the round counts for what it accepted.
    policy.observe([0.9, 0.8], accepted=1, draft_seconds=0.0, context=10)
    assert policy.gate.efficiency == pytest.approx((1 + 0.9 + 0.72 + 2) / 2)


def test_gate_averages_its_first_rounds_evenly():
    """Until a full smoothing window of rounds is in, the gate's efficiency is their plain mean, so
    a bad first round does not outweigh the next ones (with smoothing 0.05 it weighed 19 of them)."""
    policy = DCutPolicy(linear_cost(1.0, 0.0), explore_every=1000, smoothing=0.25)
    rates = [0.5, 1.5, 1.3, 1.1]
    for tokens in rates:
        policy.observe([], accepted=round(tokens * 10) - 1, draft_seconds=9.0, context=10)  # 10x the time
    assert policy.gate.efficiency == pytest.approx(sum(rates) / 4)
    policy.observe([], accepted=19, draft_seconds=9.0, context=10)  # rate 2.0, now at the smoothing
    assert policy.gate.efficiency == pytest.approx(0.75 * 1.1 + 0.25 * 2.0)


def test_the_engine_gate_rides_out_a_dip_and_closes_on_a_steady_loss():
    """The engine's gate averages about 20 drafting steps and closes below 1: a single step's dip
    (a few-row step's measurement is noisy) leaves a paying drafter open, while a drafter that runs
    steadily at 0.95x plain decoding closes (with a 0.9 margin on a 5-step average it kept drafting
    chat at 0.95-0.97x). An explicit ``close_below`` still sets the margin and is checked."""
    from angelspec_hf.generation import BatchDCutPolicy
    from angelspec_hf.generation.dcut import DraftGate

    def gate_after(rates, **kwargs):
        gate = BatchDCutPolicy(batch16_cost(), **kwargs).gate_for("drafter")
        for rate in rates:
            gate.record_rate(tokens=rate, seconds=1.0, plain_tokens=1.0, plain_seconds=1.0)
        return gate

    assert gate_after([1.3] * 30 + [0.44]).paying
    assert not gate_after([0.95] * 30).paying
    assert gate_after([0.95] * 30, smoothing=0.2, close_below=0.9).paying
    batch1 = DCutPolicy(linear_cost(1.0, 0.0)).gate
    batch1.record_rate(tokens=0.95, seconds=1.0, plain_tokens=1.0, plain_seconds=1.0)
    assert not batch1.paying
    with pytest.raises(ValueError, match="close_below"):
        DraftGate(close_below=1.5)


@pytest.mark.parametrize("budget, wait", [(None, 16), (0.02, 400), (0.5, 16), ("default", 1600)])
def test_batch_retries_wait_until_their_loss_fits_the_probe_budget(budget, wait):
    from angelspec_hf.generation import BatchDCutPolicy

    budget = {} if budget == "default" else {"probe_budget": budget}  # the default: 0.5% of the time
    policy = BatchDCutPolicy(batch16_cost(), explore_every=8, **budget)
    # 16 rows drafted, none accepted: 2 s drafting + 16 s verifying for 16 tokens a plain step
    # makes in 2 s, so the round lost 8 plain steps.
    policy.observe([([0.9] * 7, 0)] * 16, batch=16, width=8, context=10, draft_seconds=2.0)
    assert policy.gate_for().lost_steps == pytest.approx(8.0)
    assert [policy.should_draft() for _ in range(wait)] == [False] * (wait - 1) + [True]


def test_batch_gate_reopens_when_the_batch_shrinks_enough_for_drafting_to_pay():
    from angelspec_hf.generation import BatchDCutPolicy

    policy = BatchDCutPolicy(batch16_cost(), explore_every=8, probe_budget=None)
    # 16 rows, nothing queued, every row accepted 3 of 7: the slowest row made 4 tokens in
    # 1.6 s drafting + 16 s verifying, where a plain step makes 1 in 2 s.
    policy.observe([([0.9] * 7, 3)] * 16, batch=16, width=8, context=10, draft_seconds=1.6, queued=False)
    assert policy.gate_for().efficiency == pytest.approx((4 / 17.6) / (1 / 2.0))
    assert policy.predicted_efficiency(16, 10) == pytest.approx(policy.gate_for().efficiency)
    # One row left: 0.1 s drafting + 1.2 s verifying 8 slots for 4 tokens, against 1 token in 1 s.
    assert policy.predicted_efficiency(1, 10) == pytest.approx((4 / 1.3) / 1.0)
    assert [policy.should_draft(16, 10, False) for _ in range(7)] == [False] * 7
    assert policy.should_draft(1, 10, False)
    assert policy.gate_for().skipped == 0
    # The queue state changed the objective: no repricing, the timed retry decides.
    assert not policy.should_draft(1, 10, True)
    # Routing asks the same of a drafter no row uses (whose gate sees no `should_draft`): closed
    # at 16 rows, open where the batch shrank enough, never repriced under the other objective.
    assert not policy.is_open() and not policy.is_open(batch=16, context=10, queued=False)
    assert policy.is_open(batch=1, context=10, queued=False)
    assert not policy.is_open(batch=1, context=10, queued=True)
    assert policy.is_open("never measured", batch=16, context=10, queued=False)
    # Open for want of evidence is not measured open (a settled routed request moves only to the latter).
    assert policy.measured() and not policy.measured("never measured")


def test_batch_dcut_calibrates_each_drafter_on_its_own():
    from angelspec_hf.generation import BatchDCutPolicy

    policy = BatchDCutPolicy(linear_cost(1.0, 0.1), explore_every=1000)
    # One drafter's 0.9 confidences always fail, the other's always hold.
    for _ in range(100):
        policy.observe([([0.9] * 3, 0), ([0.9] * 3, 3)], batch=2, width=4, context=10, draft_seconds=0.0,
                       arms=["overconfident", "honest"])
    assert policy.calibrator_for("overconfident")(0.9) < 0.1
    assert policy.calibrator_for("honest")(0.9) > 0.9
    assert policy.calibrator(0.9) == pytest.approx(0.9)  # rows without a drafter name: untouched
    # Alone in the batch, the honest drafter's draft is verified whole, the other's not at all.
    assert policy.window([[0.9] * 3], batch=1, context=10, arms=["honest"]) == 4
    assert policy.window([[0.9] * 3], batch=1, context=10, arms=["overconfident"]) == 1


def _gated_steps(policy, arms, confidences, draft_seconds, queued=True, steps=20):
    """``steps`` engine steps of 4 rows at context 10, each row accepting nothing."""
    for _ in range(steps):
        width = policy.window(confidences, batch=4, context=10, queued=queued, arms=arms)
        policy.observe([(row, 0) for row in confidences], batch=4, width=width, context=10,
                       draft_seconds=draft_seconds, queued=queued, arms=arms)


def test_batch_dcut_gates_each_drafter_on_its_own():
    """A drafter whose rows cost drafting time and gain nothing closes its own gate, not the gate
    of the drafter beside it whose rows pay (one gate for both closed on the pair's mean)."""
    from angelspec_hf.generation import BatchDCutPolicy

    rows = [[0.9] * 7] * 2 + [[0.05] * 7] * 2
    # Verifying 8 slots costs 1.2 plain steps; the costly drafter spends 3 s a step, the other 0.1 s.
    split = BatchDCutPolicy(linear_cost(1.0, 0.2 / 7), explore_every=1000, track_pace=False)
    _gated_steps(split, ["pays"] * 2 + ["costly"] * 2, rows, {"pays": 0.1, "costly": 3.0})
    shared = BatchDCutPolicy(linear_cost(1.0, 0.2 / 7), explore_every=1000, track_pace=False)
    _gated_steps(shared, None, rows, 3.1)
    # The calibration learns that nothing is accepted; the gates weigh what each step expected.
    assert split.gate_for("pays").efficiency > 1.0 and split.should_draft(4, 10, arm="pays")
    assert split.gate_for("costly").efficiency < 1.0 and not split.should_draft(4, 10, arm="costly")
    assert shared.gate_for().efficiency < 1.0 and not shared.should_draft(4, 10)
    # What routing weighs: open before a drafter is measured, closed while its drafting does not pay.
    assert split.is_open("pays") and not split.is_open("costly") and split.is_open("unmeasured")


@pytest.mark.parametrize("queued", [True, False])
def test_drafters_with_the_same_rows_are_gated_like_one(queued):
    """Each drafter's share of a step (its rows' tokens, its drafting, its rows' share of the
    forward) adds up to the step: two drafters serving alike rows each see the step's efficiency."""
    from angelspec_hf.generation import BatchDCutPolicy

    rows = [[0.9, 0.6, 0.3]] * 3
    policies = [BatchDCutPolicy(linear_cost(1.0, 0.3), explore_every=1000, track_pace=False) for _ in range(2)]
    # 3 of the 4 rows draft; the fourth advances its one token. One step: after it the drafters'
    # calibrations differ (they saw different rows).
    for policy, arms, seconds in ((policies[0], None, 0.6), (policies[1], ["a", "b", "a"], {"a": 0.4, "b": 0.2})):
        width = policy.window(rows, batch=4, context=10, queued=queued, remaining=[20, 20, 20, 5], arms=arms)
        assert width == 3
        policy.observe([(row, 1) for row in rows], batch=4, width=width, context=10, draft_seconds=seconds,
                       queued=queued, arms=arms)
    one, (a, b) = policies[0].gate_for(), (policies[1].gate_for(arm) for arm in "ab")
    assert a.efficiency == pytest.approx(one.efficiency) and b.efficiency == pytest.approx(one.efficiency)
    assert a.row_draft_seconds == pytest.approx(one.row_draft_seconds) == pytest.approx(0.2)
    assert policies[1].predicted_efficiency(2, 10, "a") == pytest.approx(policies[0].predicted_efficiency(2, 10))


def test_batch_gate_without_a_measured_step_cannot_predict():
    from angelspec_hf.generation import BatchDCutPolicy

    policy = BatchDCutPolicy(batch16_cost())
    assert policy.should_draft(1, 10, False)  # unmeasured, it drafts where a first step may pay
    with pytest.raises(ValueError, match="measured drafting step"):
        policy.predicted_efficiency(16, 10)


def test_probe_budget_bounds_the_time_lost_to_retries():
    from angelspec_hf.generation import BatchDCutPolicy

    policy = BatchDCutPolicy(batch16_cost(), explore_every=8, probe_budget=0.02)
    lost = plain = 0.0
    for _ in range(5000):
        if policy.should_draft():
            policy.observe([([0.9] * 7, 0)] * 16, batch=16, width=8, context=10, draft_seconds=2.0)
            lost += policy.gate_for().lost_steps
        else:
            plain += 1
    assert 0 < lost <= 0.02 * plain + 8  # the very first round is not a retry


def test_probe_budget_is_checked():
    from angelspec_hf.generation import BatchDCutPolicy

    with pytest.raises(ValueError, match="probe_budget"):
        BatchDCutPolicy(batch16_cost(), probe_budget=2.0)


@pytest.mark.parametrize("kind", ["mtp", "dfly-hybrid-corr", "dfly-global-nocorr"])
@pytest.mark.parametrize("per_token", [0.002, 0.5])
def test_generate_with_dcut_stays_identical_and_follows_the_cost(targets, kind, per_token):
    target = targets.target("llama")
    drafter = targets.fitted("llama", kind)
    # Seconds per verification far above the tiny drafter's own cost, taken as this machine's (no
    # pace), so only the curve decides.
    policy = drafter.draft_policy = DCutPolicy(linear_cost(1.0, per_token), explore_every=8, track_pace=False)
    try:
        drafted = []
        for row in targets.sequences("llama")[:4]:
            prompt = row[None, :PROMPT_LENGTH]
            plain = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None)
            fast = target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False, eos_token_id=None)
            assert torch.equal(plain, fast)
            drafted += drafter.last_speculation_stats.drafted
    finally:
        del drafter.draft_policy
    if per_token == 0.002:  # verifying more is nearly free: long drafts once calibrated
        assert sum(drafted) / len(drafted) >= 0.5 * drafter.max_draft_tokens, drafted
    else:  # a verified token costs half a step: only exploration rounds keep long drafts
        assert sum(d > 2 for d in drafted) <= policy.decisions // policy.explore_every + 1, drafted


def test_fixed_length_policy_keeps_everything(targets):
    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-layerwise-corr")
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    drafter.draft_policy = FixedLengthPolicy()
    try:
        target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=None)
        with_policy = drafter.last_speculation_stats.as_dict()
    finally:
        del drafter.draft_policy
    target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert drafter.last_speculation_stats.as_dict() == with_policy


def brute_force_with_alternatives(confidences, gains, max_width, verify, sunk=0.0):
    """The cut by enumeration: keeping k >= 1 drafts verifies as many alternatives as fit
    ``max_width`` tokens beside them, each adding its gain; keeping none verifies none."""
    def rate(k):
        count = 0 if k == 0 else max(0, min(len(gains), max_width - (k + 1)))
        expected = 1.0 + sum(torch.tensor(confidences[:j]).prod().item() for j in range(1, k + 1)) + sum(gains[:count])
        return expected / (sunk + verify(k + 1 + count))
    return max(range(len(confidences) + 1), key=rate)


@pytest.mark.parametrize("max_width", [0, 4, 6, 64])
def test_best_cut_with_alternatives_is_the_brute_force_optimum(max_width):
    model = linear_cost(0.1, 0.02)
    verify = lambda n: model.verify_seconds(n, 100)  # noqa: E731
    generator = torch.Generator().manual_seed(max_width)
    for _ in range(100):
        confidences = torch.rand(5, generator=generator).tolist()
        gains = (torch.rand(2, generator=generator) * 0.3).tolist()
        for sunk in (0.0, 0.05):
            got = best_cut(confidences, verify, sunk, gains, max_width)
            assert got == brute_force_with_alternatives(confidences, gains, max_width, verify, sunk)
        # No alternatives, or no room for any: the chain's own cut.
        assert best_cut(confidences, verify, 0.0, [], max_width) == best_cut(confidences, verify)
    assert best_cut([0.9, 0.5], verify, 0.0, [0.3], 2) == best_cut([0.9, 0.5], verify)


def test_alternatives_keep_a_draft_whose_first_token_is_unsure():
    """A chain whose first token is rarely right is not worth a wider forward on its own, but the
    runner-ups verified beside it are: 1 token for 1 s, against (1 + 0.1 + 0.05 + 0.25 + 0.15) tokens
    for 1.25 s with two alternatives (the reference CPU's forwards of 2-5 tokens cost about that)."""
    cost = {1: 1.0, 2: 1.25, 3: 1.25, 4: 1.25, 5: 1.25, 6: 1.3}.get
    assert best_cut([0.1, 0.5], cost) == 0  # 1.15 / 1.25 < 1
    assert best_cut([0.1, 0.5], cost, 0.0, [0.25, 0.15], 6) == 2  # 1.55 / 1.25 against 1.5 / 1.25
    assert best_cut([0.1, 0.5], cost, 0.0, [0.25, 0.15], 4) == 1  # one fits beside 2 drafts: 1.4 / 1.25
    assert worth_extending([0.1], cost, 3, alternative_gains=[0.25, 0.15], alternatives_width=6)


def test_dcut_calibrates_the_alternatives_and_prices_their_width():
    cost = CostModel(target="t", hardware="t", tokens=[1, 2, 8], contexts=[0, 100],
                     seconds=[[1.0, 1.0], [1.25, 1.25], [1.25, 1.25]])
    policy = DCutPolicy(cost, explore_every=1000)
    assert policy.weighs_alternatives
    assert policy.choose([0.1, 0.5], context=10) == 0
    # Runner-ups drafted at 0.3 that the target took half the time: calibrated near 0.5.
    for round_ in range(40):
        policy.observe([0.1], accepted=0, draft_seconds=0.0, context=10,
                       alternatives=[0.3, 0.2], alternative_hit=0 if round_ % 2 else None)
    assert policy.alternative_calibrator(0.3) == pytest.approx((20 + 4 * 0.3) / (40 + 4))
    assert policy.alternative_calibrator(0.2) == pytest.approx(4 * 0.2 / (40 + 4))
    keep = policy.choose([0.1, 0.5], context=10, alternatives=[0.3, 0.2], alternatives_width=6)
    assert keep == 2
    gain = 1 + policy.calibrator(0.1) + policy.calibrator(0.1) * policy.calibrator(0.5)
    gain += policy.alternative_calibrator(0.3) + policy.alternative_calibrator(0.2)
    assert policy.expected_gain == pytest.approx(gain)
    # The gate prices the forward the round really made: the chain, its pending token and both alternatives.
    efficiency = policy.gate.efficiency
    policy.observe([0.1, 0.5], accepted=0, draft_seconds=0.0, context=10, alternatives=[0.3, 0.2], alternative_hit=0)
    ratio = (gain / cost.verify_seconds(5, 10)) / (1 / cost.verify_seconds(1, 10))
    assert policy.gate.efficiency == pytest.approx(0.95 * efficiency + 0.05 * ratio)


def test_worth_extending_matches_the_brute_force_optimum():
    """Stopping where extending no longer pays never stops before the optimum of the full draft."""
    # A linear cost, and one measured shape: 2 tokens dearer than 4 or 8 (MKL's few-row kernels).
    measured = CostModel(target="t", hardware="t", tokens=[1, 2, 4, 8, 16], contexts=[0, 4096],
                         seconds=[[0.059] * 2, [0.124] * 2, [0.121] * 2, [0.102] * 2, [0.112] * 2])
    for model in (linear_cost(0.1, 0.03), measured):
        verify = lambda n: model.verify_seconds(n, 100)  # noqa: E731
        generator = torch.Generator().manual_seed(3)
        for _ in range(100):
            confidences = sorted(torch.rand(7, generator=generator).tolist(), reverse=True)
            survival = torch.tensor(confidences).cumprod(0).tolist()
            stop = next((j for j in range(1, 8) if not worth_extending(survival[:j], verify, 7)), 7)
            assert stop >= brute_force(confidences, verify)
    # With drafting time per position the stop never comes before the best drafted depth either.
    for per_position in (0.005, 0.03):
        verify = lambda n: linear_cost(0.1, 0.03).verify_seconds(n, 100)  # noqa: E731
        generator = torch.Generator().manual_seed(4)
        for _ in range(100):
            confidences = sorted(torch.rand(7, generator=generator).tolist(), reverse=True)
            survival = torch.tensor(confidences).cumprod(0).tolist()
            depth = max(range(8), key=lambda k: (1 + sum(survival[:k])) / (k * per_position + verify(k + 1)))
            stop = next((j for j in range(1, 8) if not worth_extending(survival[:j], verify, 7, per_position)), 7)
            assert stop >= depth
    # A cost that dips after a rise: a one-step look-ahead stops after one draft (the second costs
    # 1.2 more for at most 0.9 tokens), but the third makes the window cheaper again and both pay.
    dip = {1: 1.0, 2: 1.2, 3: 2.4, 4: 1.3}
    assert brute_force([0.9] * 3, dip.get) == 3
    assert worth_extending([0.9], dip.get, 3) and worth_extending([0.9, 0.81], dip.get, 3)
    assert not worth_extending([0.9, 0.81, 0.729], dip.get, 3)


def test_saved_profiles_of_an_older_format_are_measured_again(targets, tmp_path, monkeypatch):
    """A profile saved in an older format (here 1: new tokens forced monotone) would keep its
    inflated multi-token costs: `load_or_profile` measures again; a current one is read back."""
    from angelspec_hf.generation import cost_model

    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    target = targets.target("llama")
    measured = []

    def fake_profile(target, name, batch_sizes=(1, 4, 16)):
        measured.append(name)
        return CostModel(target=name, hardware=cost_model.hardware_id(), tokens=[1, 2], contexts=[0, 8],
                         seconds=[[[1.0, 1.0], [0.5, 0.5]]] * len(batch_sizes), batch_sizes=list(batch_sizes),
                         profile_format=cost_model.PROFILE_FORMAT)

    monkeypatch.setattr(cost_model, "profile_target", fake_profile)
    path = cost_model.profile_path("tiny@float32")
    old = CostModel(target="tiny@float32", hardware=cost_model.hardware_id(), tokens=[1, 2], contexts=[0, 8],
                    seconds=[[[1.0, 1.0], [1.0, 1.0]]] * 2, batch_sizes=[1, 4])
    old.save(path)
    assert old.profile_format == 1
    again = cost_model.load_or_profile(target, "tiny")
    assert measured == ["tiny@float32"] and again.verify_seconds(2, 0) == pytest.approx(0.5)
    reread = cost_model.load_or_profile(target, "tiny")
    assert measured == ["tiny@float32"], "a current profile is not measured again"
    assert reread.profile_format == cost_model.PROFILE_FORMAT and reread.verify_seconds(2, 0) == pytest.approx(0.5)


def test_saved_profiles_are_keyed_by_exact_kernels_and_cover_the_batch_sizes_asked_for(tmp_path, monkeypatch):
    """An exact-verification (or packed) target is profiled apart from the stock one, and a profile of batch 1
    only serves batch-1 use but is measured again when the engine's batch sizes are asked for."""
    from angelspec_hf.generation import cost_model
    from angelspec_hf.generation.exact import make_verification_exact
    from angelspec_hf.reference import tiny_target

    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    measured = []

    def fake_profile(target, name, batch_sizes=(1, 4, 16)):
        measured.append((name, tuple(batch_sizes)))
        return CostModel(target=name, hardware=cost_model.hardware_id(), tokens=[1, 2], contexts=[0, 8],
                         seconds=[[[1.0, 1.0], [0.5, 0.5]]] * len(batch_sizes), batch_sizes=list(batch_sizes),
                         profile_format=cost_model.PROFILE_FORMAT)

    monkeypatch.setattr(cost_model, "profile_target", fake_profile)
    target = tiny_target("llama").to(torch.bfloat16)
    make_verification_exact(target, max_rows=4)
    cost_model.load_or_profile(target, "tiny", batch_sizes=(1,))
    cost_model.load_or_profile(target, "tiny", batch_sizes=(1,))
    assert measured == [("tiny@bfloat16+exact", (1,))]
    cost_model.load_or_profile(target, "tiny")
    assert measured[-1] == ("tiny@bfloat16+exact", cost_model.ENGINE_BATCH_SIZES)
    from angelspec_hf.generation.packed import pack_linear_weights, packing_available

    if packing_available():  # packed float32 linears verify at other costs: a profile of their own
        packed = tiny_target("llama")
        cost_model.load_or_profile(packed, "tiny", batch_sizes=(1,))
        pack_linear_weights(packed)
        cost_model.load_or_profile(packed, "tiny", batch_sizes=(1,))
        assert measured[-2:] == [("tiny@float32", (1,)), ("tiny@float32+packed", (1,))]


@pytest.mark.parametrize("slowdown", [0.5, 2.0, 3.0])
def test_drafting_time_counts_at_the_profiles_speed(slowdown):
    """On a machine running at another speed than its profile (a saved profile reused in a slow
    spell), drafting and forwards are both slower by the same factor. The pace of the recorded
    forwards puts drafting back into the profile's time, so efficiency, learned drafting time and
    windows are what they are at the profile's speed; without it slow drafting closes the gate."""
    from angelspec_hf.generation import BatchDCutPolicy

    def step(policy, machine):
        # Batch 1: verifying 8 tokens costs 1.2 s, one token 1.0 s (`batch16_cost`); 2 s drafting.
        policy.record_forward(1.2 * machine, width=8, context=10)
        width = policy.window([[0.9] * 7], batch=1, context=10)
        policy.observe([([0.9] * 7, 3)], batch=1, width=width, context=10, draft_seconds=2.0 * machine)

    at_speed, elsewhere, unpaced = (BatchDCutPolicy(batch16_cost(), explore_every=1000, track_pace=track)
                                    for track in (True, True, False))
    for _ in range(20):
        step(at_speed, 1.0)
        step(elsewhere, slowdown)
        step(unpaced, slowdown)
    assert at_speed.pace == pytest.approx(1.0) and elsewhere.pace == pytest.approx(slowdown)
    assert elsewhere.gate_for().efficiency == pytest.approx(at_speed.gate_for().efficiency)
    assert elsewhere.gate_for().row_draft_seconds == pytest.approx(at_speed.gate_for().row_draft_seconds) == pytest.approx(2.0)
    assert elsewhere.windows == at_speed.windows
    # At the profile's speed drafting pays (about 3.7 expected tokens in 3.2 s against 1 a second);
    # counted on the wall clock of a machine 2-3x slower than its profile it would not.
    assert at_speed.gate_for().efficiency > 1.1 and at_speed.should_draft(1, 10) and elsewhere.should_draft(1, 10)
    if slowdown > 1.5:
        assert unpaced.gate_for().efficiency < 1.0 and not unpaced.should_draft(1, 10)


def test_batch1_dcut_learns_the_pace_and_drafts_as_at_the_profiles_speed():
    """The batch-1 policy likewise: drafting time per position in the profile's time."""
    model = linear_cost(1.0, 0.01)
    at_speed, slow = DCutPolicy(model, explore_every=1000), DCutPolicy(model, explore_every=1000)
    for policy, machine in ((at_speed, 1.0), (slow, 2.5)):
        for _ in range(30):
            policy.record_forward(model.verify_seconds(4, 50) * machine, width=4, context=50)
            policy.choose([0.8, 0.8, 0.8], context=50)
            policy.observe([0.8, 0.8, 0.8], accepted=2, draft_seconds=0.3 * machine, context=50)
    assert slow.pace == pytest.approx(2.5)
    assert slow.position_seconds == pytest.approx(at_speed.position_seconds) == pytest.approx(0.1)
    assert slow.gate.efficiency == pytest.approx(at_speed.gate.efficiency)


def test_generate_tells_the_policy_how_long_each_verify_forward_took(targets):
    """`generate` reports every round's forward (width: the drafted tokens + 1, plus the first-token
    alternatives verified beside them, up to a forward of 6) to the policy."""
    target, drafter = targets.target("llama"), targets.fitted("llama", "dfly-hybrid-corr")
    policy = DCutPolicy(linear_cost(0.01, 0.001), explore_every=4)
    forwards = []
    record = policy.record_forward

    def recording(seconds, width, context, batch=1):
        forwards.append((seconds, width, context, batch))
        record(seconds, width, context, batch)

    policy.record_forward = recording
    drafter.draft_policy = policy
    prompt = targets.sequences("llama")[:1, :PROMPT_LENGTH]
    try:
        fast = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None)
    finally:
        del drafter.draft_policy
    assert torch.equal(fast, target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None))
    drafted = drafter.last_speculation_stats.drafted
    alternatives = [min(2, max(0, 6 - (d + 1))) if d else 0 for d in drafted]
    assert [width for _, width, _, _ in forwards] == [d + 1 + a for d, a in zip(drafted, alternatives)]
    contexts = [context for _, _, context, _ in forwards]
    assert contexts[0] == PROMPT_LENGTH + 1 and contexts == sorted(contexts)
    assert all(seconds > 0 and batch == 1 for seconds, _, _, batch in forwards)
    assert policy.pace is not None and policy.pace > 0


def fake_profiler(cost_model, measured: list):
    """A `profile_target` stand-in that records what it was asked to measure."""
    def fake_profile(target, name, batch_sizes=(1,)):
        measured.append(name)
        return CostModel(target=name, hardware=cost_model.hardware_id(target.device), tokens=[1, 2], contexts=[0, 8],
                         seconds=[[[1.0, 1.0], [0.5, 0.5]]] * len(batch_sizes), batch_sizes=list(batch_sizes),
                         profile_format=cost_model.PROFILE_FORMAT)
    return fake_profile


def test_a_broken_or_foreign_saved_profile_is_named_and_measured_again(targets, tmp_path, monkeypatch, caplog):
    """A profile cut short, with fields missing or seconds that are no times is a ValueError naming the
    file; `load_or_profile` warns and measures again, as for the profile of a target whose name only
    differs in characters a file name cannot hold. Saving leaves no partial file behind."""
    from angelspec_hf.generation import cost_model

    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(cost_model, "profile_target", fake_profiler(cost_model, measured))
    target = targets.target("llama")
    path = cost_model.profile_path("org/m@float32", target.device)
    path.parent.mkdir(parents=True)
    good = CostModel(target="org/m@float32", hardware=cost_model.hardware_id(target.device), tokens=[1, 2],
                     contexts=[0, 8], seconds=[[1.0, 1.0], [0.5, 0.5]], profile_format=cost_model.PROFILE_FORMAT)
    text = json.dumps(dataclasses.asdict(good))
    broken = {"cut short": text[: len(text) // 2], "a field missing": text.replace('"seconds"', '"secs"'),
              "no times": text.replace("0.5", "NaN"), "empty": ""}
    for what, content in broken.items():
        path.write_text(content)
        with pytest.raises(ValueError, match="is not a readable cost profile") as info:
            CostModel.load(path)
        assert str(path) in str(info.value), what
        with caplog.at_level(logging.WARNING):
            assert cost_model.load_or_profile(target, "org/m", batch_sizes=(1,)).target == "org/m@float32"
        assert measured[-1] == "org/m@float32" and "profiling again" in caplog.text, what
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # saved whole, nothing partial
    assert cost_model.profile_path("org_m@float32", target.device) == path
    cost_model.load_or_profile(target, "org_m", batch_sizes=(1,))
    assert measured[-1] == "org_m@float32", "another target's profile at the same path is not used"
    with pytest.raises(ValueError, match="distinct"):
        CostModel(target="t", hardware="h", tokens=[1, 1], contexts=[0], seconds=[[1.0], [1.0]])


def test_profiles_are_keyed_by_the_targets_device_not_the_machines(tmp_path, monkeypatch):
    """On a machine with a GPU, a CPU target's profile is the CPU's: keyed by the GPU it shared a file
    with the GPU target's, and each loaded the other's without a warning."""
    from angelspec_hf.generation import cost_model

    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"Fake GPU {torch.device(device).index}")
    assert cost_model.hardware_id("cpu").startswith("cpu:") and "Fake GPU" not in cost_model.hardware_id("cpu")
    assert cost_model.hardware_id("cuda:1") == "cuda:Fake GPU 1"
    assert cost_model.hardware_id() == "cuda:Fake GPU None"  # no device: the machine's first GPU, as before
    assert cost_model.profile_path("t", "cpu") != cost_model.profile_path("t", "cuda:0")
    assert cost_model.profile_path("t", "cuda:0") != cost_model.profile_path("t", "cuda:1")


def test_long_target_names_give_profile_file_names_a_file_system_takes(tmp_path, monkeypatch):
    from angelspec_hf.generation import cost_model

    monkeypatch.setenv("ANGELSPEC_HF_HOME", str(tmp_path))
    deep = "/".join(["checkpoints"] * 20)
    paths = [cost_model.profile_path(f"{deep}/{name}@float32", "cpu") for name in ("run-a", "run-b")]
    assert paths[0] != paths[1] and all(len(path.name) <= 255 for path in paths)
    CostModel(target="t", hardware="h", tokens=[1], contexts=[0], seconds=[[1.0]]).save(paths[0])
    assert cost_model.profile_path("short@float32", "cpu").name.startswith("short_float32--cpu")


def test_cost_model_axes_in_any_order_and_new_tokens_past_the_grid():
    """Axes are sorted with their grid (unsorted, the monotone fit copied the largest batch's times into
    the smaller ones); new tokens past the grid go on along its last step, not flat."""
    ordered = CostModel(target="t", hardware="h", tokens=[1, 8, 16], contexts=[0, 100], batch_sizes=[1, 4],
                        seconds=[[[1.0, 1.5], [1.2, 1.8], [1.6, 2.6]], [[2.0, 3.0], [4.0, 6.0], [8.0, 12.0]]])
    shuffled = CostModel(target="t", hardware="h", tokens=[16, 1, 8], contexts=[100, 0], batch_sizes=[4, 1],
                         seconds=[[[12.0, 8.0], [3.0, 2.0], [6.0, 4.0]], [[2.6, 1.6], [1.5, 1.0], [1.8, 1.2]]])
    assert shuffled.seconds == ordered.seconds and shuffled.batch_sizes == [1, 4] and shuffled.tokens == [1, 8, 16]
    assert ordered.verify_seconds(1, 0) == pytest.approx(1.0)
    assert ordered.verify_seconds(16, 0) == pytest.approx(1.6)
    assert ordered.verify_seconds(32, 0) == pytest.approx(1.6 + 16 * (1.6 - 1.2) / 8)
    assert ordered.verify_seconds(24, 100, batch=4) == pytest.approx(12.0 + 8 * (12.0 - 6.0) / 8)
    flat_then_cheaper = CostModel(target="t", hardware="h", tokens=[1, 8, 16], contexts=[0],
                                  seconds=[[1.0], [2.0], [1.5]])
    assert flat_then_cheaper.verify_seconds(40, 0) == pytest.approx(1.5)  # never below the last point


def test_confidences_that_are_not_probabilities_do_not_stop_dcut():
    """A drafter whose logits overflowed gives NaN confidences: D-cut reads them as 0 (and clamps the
    rest to [0, 1]) instead of raising from the calibration's binning."""
    policy = DCutPolicy(CostModel(target="t", hardware="h", tokens=[1, 8], contexts=[0, 100],
                                  seconds=[[1.0, 1.0], [1.1, 1.1]]), track_pace=False)
    weird = [1.0, float("nan"), float("inf"), -float("inf"), 1.5, -0.25]
    assert policy.keep_drafting(weird, context=10) in (True, False)
    assert policy.choose(weird, context=10) in (0, 1)  # everything after the NaN survives with 0
    policy.observe(weird, accepted=1, draft_seconds=0.01, context=10)
    calibrator = Calibrator()
    assert calibrator(float("nan")) == 0.0 and calibrator(2.0) == 1.0 and calibrator(-1.0) == 0.0
    with pytest.raises(ValueError, match="explore_every"):
        DCutPolicy(CostModel(target="t", hardware="h", tokens=[1], contexts=[0], seconds=[[1.0]]), explore_every=0)
