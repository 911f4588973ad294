"""The engine's cache: appends in place, holds exactly what concatenation would, never writes into
tensors it does not own."""

import pytest
import torch
import angelspec_hf.generation.buffered_cache as buffered
from angelspec_hf.generation.buffered_cache import BufferedCache, BufferedLayer
from angelspec_hf.generation.engine import SpeculativeEngine
from angelspec_hf.reference import tiny_target


def states(batch: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 2, columns, 4, generator=generator),
            torch.randn(batch, 2, columns, 4, generator=generator))


def concatenated(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


def test_appends_equal_concatenation_and_copy_only_when_full():
    layer, parts, buffers = BufferedLayer(), [], set()
    for step in range(60):
        part = states(3, 5 if step == 0 else 1, seed=step)
        parts.append(part)
        keys, values = layer.update(*part)
        expected_keys, expected_values = concatenated(parts)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
        assert keys is layer.keys and values is layer.values
        buffers.add(layer._buffers[0].data_ptr())
    # 64 columns from 5: buffers of 37, then 69 columns (a quarter more, at least 32 free).
    assert len(buffers) == 2


def test_kept_columns_are_a_view_and_later_appends_follow_them():
    layer = BufferedLayer()
    first = states(2, 10, seed=0)
    layer.update(*first)
    buffer = layer._buffers[0].data_ptr()
    layer.keep_columns(3, 8)
    assert layer._buffers[0].data_ptr() == buffer
    second = states(2, 2, seed=1)
    keys, values = layer.update(*second)
    expected = concatenated([(first[0][:, :, 3:8], first[1][:, :, 3:8]), second])
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert layer._buffers[0].data_ptr() == buffer, "the columns after the view are free for appends"
    assert layer.get_seq_length() == 7


def test_selected_rows_keep_their_columns_and_room():
    layer = BufferedLayer()
    parts = [states(4, 6, seed=0)]
    layer.update(*parts[0])
    layer.keep_columns(1, 6)
    layer.batch_select_indices(torch.tensor([3, 1]))
    parts = [(parts[0][0][[3, 1], :, 1:], parts[0][1][[3, 1], :, 1:]), states(2, 1, seed=1)]
    keys, values = layer.update(*parts[1])
    expected = concatenated(parts)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


def test_stacked_rows_are_left_padded_with_zeros(monkeypatch):
    # Free buffer memory filled with NaN: a padding column left unwritten would carry it into the
    # masked scores, where the mask cannot remove it.
    def poisoned(like, rows, needed):
        return torch.full((rows, like.shape[1], needed + 32, like.shape[-1]), float("nan"), dtype=like.dtype)

    monkeypatch.setattr(buffered, "_new_buffer", poisoned)
    short, long = BufferedLayer(), BufferedLayer()
    short_states, long_states = states(1, 3, seed=0), states(2, 5, seed=1)
    short.update(*short_states)
    long.update(*long_states)
    long.stack([long, short], 5)
    pad = torch.zeros(1, 2, 2, 4)
    assert torch.equal(long.keys, torch.cat([long_states[0], torch.cat([pad, short_states[0]], dim=2)]))
    assert torch.equal(long.values, torch.cat([long_states[1], torch.cat([pad, short_states[1]], dim=2)]))
    appended = states(3, 1, seed=2)
    keys, _ = long.update(*appended)
    assert not keys.isnan().any() and torch.equal(keys[:, :, -1:], appended[0])


def test_tensors_put_in_from_outside_are_copied_not_written_into():
    layer = BufferedLayer()
    layer.update(*states(1, 4, seed=0))
    outside = states(1, 6, seed=1)
    kept = (outside[0].clone(), outside[1].clone())
    layer.keys, layer.values = outside  # what a caller or transformers' crop/offload may do
    appended = states(1, 1, seed=2)
    keys, values = layer.update(*appended)
    assert torch.equal(outside[0], kept[0]) and torch.equal(outside[1], kept[1])
    assert torch.equal(keys, concatenated([kept, appended])[0])
    layer.crop(-3)  # transformers' own crop slices; the next append copies
    keys, _ = layer.update(*appended)
    assert torch.equal(keys, torch.cat([kept[0][:, :, :4], appended[0]], dim=2))


def test_the_engine_decodes_in_a_buffered_cache_without_copying_every_step():
    target = tiny_target("llama", seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    engine = SpeculativeEngine(target, None, max_batch_size=3)
    for prompt in prompts:
        engine.submit(prompt, max_new_tokens=40, eos_token_id=None)
    buffers = []
    with torch.no_grad():
        while engine.has_work:
            engine.step()
            if engine._cache is not None:
                layer = engine._cache.layers[0]
                assert isinstance(layer, BufferedLayer) and isinstance(engine._cache, BufferedCache)
                buffers.append(layer._buffers[0].data_ptr())
    changes = sum(a != b for a, b in zip(buffers, buffers[1:]))
    assert len(buffers) >= 38 and changes <= 3


def test_a_placed_row_is_left_padded_with_zeros_and_must_fit():
    layer, other = BufferedLayer(), BufferedLayer()
    mine, theirs = states(3, 6, seed=3), states(2, 4, seed=4)
    layer.update(*mine)
    other.update(*theirs)
    layer.place(1, other, 0)
    assert torch.equal(layer.keys[1], torch.cat([torch.zeros(2, 2, 4), theirs[0][0]], dim=1))
    assert torch.equal(layer.values[1], torch.cat([torch.zeros(2, 2, 4), theirs[1][0]], dim=1))
    assert torch.equal(layer.keys[0], mine[0][0]) and torch.equal(layer.keys[2], mine[0][2])  # the others untouched
    wide = BufferedLayer()
    wide.update(*states(1, 8, seed=5))
    with pytest.raises(ValueError, match="does not fit"):
        layer.place(0, wide, 0)


def test_joining_requests_take_over_finished_rows_without_restacking_the_batch(monkeypatch):
    """While requests wait, a finished request's cache row is handed to the next joining request
    (written in place) instead of the batch's cache being copied twice (rows dropped, rows stacked);
    every output stays that of plain decoding alone."""
    from angelspec_hf import DFlyDrafter

    target = tiny_target("llama", seed=0)
    drafter = DFlyDrafter.from_target(target, block_size=4).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4], [17, 18, 19], [20, 21, 22, 23], [7, 8, 9]]
    lengths = [9, 14, 6, 11, 7, 12, 8]  # rows finish on different steps
    calls = {"place": 0, "stack": 0}
    for name in calls:
        def counted(self, *args, _name=name, _original=getattr(BufferedLayer, name)):
            calls[_name] += 1
            return _original(self, *args)
        monkeypatch.setattr(BufferedLayer, name, counted)
    for model in (None, drafter):
        engine = SpeculativeEngine(target, model, max_batch_size=3)
        for prompt, length in zip(prompts, lengths):
            engine.submit(prompt, max_new_tokens=length, eos_token_id=None)
        outputs = {}
        with torch.no_grad():
            while engine.has_work:
                for event in engine.step():
                    outputs.setdefault(event.request, []).extend(event.tokens)
        for index, (prompt, length) in enumerate(zip(prompts, lengths)):
            expected = target.generate(torch.tensor([prompt]), max_new_tokens=length, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert outputs[index] == expected, (model, index)
    assert calls["place"] and calls["place"] > calls["stack"], calls
