"""Tests for admin_ds.data: the binarized format, collation, batching and the iterator.

Everything runs on real files in pytest's tmp_path. Expected values come from
independent references (raw struct/np.fromfile parsing of the files, a plain
Python greedy batcher, hand-written tensors), never from the code under test.
"""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from admin_ds.data import (
    EpochBatchIterator,
    IndexedDataset,
    IndexedDatasetWriter,
    ParallelDataset,
    collate,
    filter_by_size,
    make_token_batches,
)
from admin_ds.data import indexed as indexed_module

PAD, EOS = 1, 2


def random_sentences(rng, n, vocab_size, max_len=30):
    # Includes empty sentences on purpose: they are legal and an easy off-by-one trap.
    return [rng.integers(0, vocab_size, rng.integers(0, max_len + 1)) for _ in range(n)]


def write(prefix, sentences, vocab_size):
    with IndexedDatasetWriter(prefix, vocab_size) as writer:
        for ids in sentences:
            writer.add(ids)
    return IndexedDataset(prefix)


def make_parallel(tmp_path, n, seed=0, vocab_size=500, max_len=30):
    rng = np.random.default_rng(seed)
    src = write(tmp_path / "train.src", random_sentences(rng, n, vocab_size, max_len), vocab_size)
    tgt = write(tmp_path / "train.tgt", random_sentences(rng, n, vocab_size, max_len), vocab_size)
    return ParallelDataset(src, tgt)


def batch_cost(src_sizes, tgt_sizes, batch):
    return len(batch) * int(np.max(np.maximum(src_sizes[batch], tgt_sizes[batch]) + 1))


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(1000, np.uint16), (65536, np.uint16), (100_000, np.int32)]
)
def test_roundtrip_matches_written_sentences_and_raw_bytes(
    tmp_path, monkeypatch, vocab_size, dtype
):
    # Tiny chunk sizes force the streaming paths (several .bin flushes, several
    # offset chunks) that real corpora hit, without needing millions of tokens.
    monkeypatch.setattr(indexed_module, "_FLUSH_TOKENS", 50)
    monkeypatch.setattr(indexed_module, "_OFFSET_CHUNK", 7)
    rng = np.random.default_rng(1)
    sentences = random_sentences(rng, 200, vocab_size)
    sentences[3] = np.array([0, vocab_size - 1])  # extremes of the id range
    prefix = tmp_path / "corpus"
    ds = write(prefix, [list(map(int, s)) for s in sentences], vocab_size)

    assert len(ds) == 200
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.dtype == np.int32
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in sentences])
    assert ds.num_tokens == sum(len(s) for s in sentences)
    for i, s in enumerate(sentences):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds[-1], sentences[-1])
    with pytest.raises(IndexError):
        ds[200]

    # Independent parse of the files as the module docstring specifies them.
    raw = open(f"{prefix}.idx", "rb").read()
    magic, version, code, n = struct.unpack_from("<8sIBQ", raw, 0)
    assert (magic, version, code, n) == (b"ADMINIDX", 1, 1 if dtype is np.uint16 else 2, 200)
    lengths = np.frombuffer(raw, "<i4", n, 21)
    offsets = np.frombuffer(raw, "<i8", n + 1, 21 + 4 * n)
    assert len(raw) == 21 + 4 * n + 8 * (n + 1)
    np.testing.assert_array_equal(lengths, [len(s) for s in sentences])
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(lengths)]))
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.dtype(dtype).newbyteorder("<"))
    np.testing.assert_array_equal(tokens, np.concatenate(sentences))


def test_empty_corpus_roundtrips(tmp_path):
    ds = write(tmp_path / "empty", [], 10)
    assert len(ds) == 0 and ds.num_tokens == 0 and len(ds.sizes) == 0


def test_files_appear_only_after_finalize_and_no_tmp_remains(tmp_path):
    prefix = tmp_path / "c"
    with IndexedDatasetWriter(prefix, 100) as writer:
        writer.add([1, 2, 3])
        assert not IndexedDataset.exists(prefix)
        assert not os.path.exists(f"{prefix}.idx") and not os.path.exists(f"{prefix}.bin")
    assert IndexedDataset.exists(prefix)
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx"]
    with pytest.raises(RuntimeError):
        writer.add([1])


def test_exception_inside_with_leaves_no_files(tmp_path):
    prefix = tmp_path / "c"
    with pytest.raises(KeyError):
        with IndexedDatasetWriter(prefix, 100) as writer:
            writer.add([1, 2, 3])
            raise KeyError("boom")
    assert os.listdir(tmp_path) == []


def test_rewrite_replaces_previous_files(tmp_path):
    prefix = tmp_path / "c"
    write(prefix, [[1, 2, 3]], 100)
    ds = write(prefix, [[4], [5, 6]], 100)
    assert len(ds) == 2
    np.testing.assert_array_equal(ds[1], [5, 6])


@pytest.mark.parametrize(("bad", "culprit"), [([3, 100], "100"), ([-1, 3], "-1")])
def test_out_of_range_id_names_sentence(tmp_path, bad, culprit):
    with IndexedDatasetWriter(tmp_path / "c", 100) as writer:
        writer.add([1, 2])
        writer.add([3])
        with pytest.raises(ValueError, match=rf"sentence 2 .*id {culprit}\b"):
            writer.add(bad)
        writer.abort()
    assert os.listdir(tmp_path) == []


def test_missing_file_raises_file_not_found_with_path(tmp_path):
    write(tmp_path / "c", [[1]], 10)
    os.remove(tmp_path / "c.bin")
    with pytest.raises(FileNotFoundError, match="c.bin"):
        IndexedDataset(tmp_path / "c")
    assert not IndexedDataset.exists(tmp_path / "c")


def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, remove):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - remove)


@pytest.mark.parametrize(
    ("damage", "bad_file", "message"),
    [
        (lambda p: _corrupt(f"{p}.idx", 0, b"NOTADMIN"), "idx", "magic"),
        (lambda p: _corrupt(f"{p}.idx", 8, struct.pack("<I", 2)), "idx", "version"),
        (lambda p: _truncate(f"{p}.idx", os.path.getsize(f"{p}.idx") - 10), "idx",
         "truncated header"),
        (lambda p: _truncate(f"{p}.idx", 8), "idx", "truncated"),
        (lambda p: _truncate(f"{p}.bin", 2), "bin", "truncated"),
        (lambda p: open(f"{p}.bin", "ab").write(b"\0\0"), "bin", "bytes"),
    ],
)
def test_corrupt_files_are_rejected_with_file_name(tmp_path, damage, bad_file, message):
    prefix = tmp_path / "corpus"
    write(prefix, [[1, 2, 3], [4, 5]], 100)
    damage(prefix)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert f"corpus.{bad_file}" in str(info.value)


def test_parallel_dataset_rejects_count_mismatch_naming_both_files(tmp_path):
    src = write(tmp_path / "a.en", [[1], [2], [3]], 10)
    tgt = write(tmp_path / "a.de", [[1], [2]], 10)
    with pytest.raises(ValueError) as info:
        ParallelDataset(src, tgt)
    msg = str(info.value)
    assert "a.en.idx" in msg and "a.de.idx" in msg and "3" in msg and "2" in msg


def test_parallel_dataset_pairs_lines(tmp_path):
    src = write(tmp_path / "a.en", [[1, 2], [3]], 10)
    tgt = write(tmp_path / "a.de", [[4], [5, 6, 7]], 10)
    pair = ParallelDataset(src, tgt)
    assert len(pair) == 2
    s, t = pair[1]
    np.testing.assert_array_equal(s, [3])
    np.testing.assert_array_equal(t, [5, 6, 7])
    np.testing.assert_array_equal(pair.src_sizes, [2, 1])
    np.testing.assert_array_equal(pair.tgt_sizes, [1, 3])


def test_indexed_dataset_pickles_by_prefix(tmp_path):
    ds = write(tmp_path / "c", [[1, 2], [3]], 10)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 500
    np.testing.assert_array_equal(clone[0], [1, 2])


# --------------------------------------------------------------------------- collate


def test_collate_matches_hand_built_tensors():
    samples = [
        (7, np.array([10, 11, 12]), np.array([20])),
        (3, np.array([13]), np.array([21, 22, 23])),
    ]
    batch = collate(samples, pad_idx=PAD, eos_idx=EOS)
    expected_src = torch.tensor([[10, 11, 12, 2], [13, 2, 1, 1]])
    expected_tgt_in = torch.tensor([[2, 20, 1, 1], [2, 21, 22, 23]])
    expected_target = torch.tensor([[20, 2, 1, 1], [21, 22, 23, 2]])
    assert torch.equal(batch["src_tokens"], expected_src)
    assert torch.equal(batch["tgt_in_tokens"], expected_tgt_in)
    assert torch.equal(batch["target"], expected_target)
    assert torch.equal(batch["ids"], torch.tensor([7, 3]))
    assert batch["ids"].dtype == batch["src_tokens"].dtype == torch.int64
    assert batch["ntokens"] == 6 and batch["nsentences"] == 2


def test_collate_pad_to_multiple_and_empty_sentences():
    sample = (0, np.array([], dtype=np.int64), np.array([5, 6]))
    batch = collate([sample], PAD, EOS, pad_to_multiple=4)
    assert torch.equal(batch["src_tokens"], torch.tensor([[2, 1, 1, 1]]))
    assert torch.equal(batch["tgt_in_tokens"], torch.tensor([[2, 5, 6, 1]]))
    assert torch.equal(batch["target"], torch.tensor([[5, 6, 2, 1]]))
    assert batch["ntokens"] == 3


# --------------------------------------------------------------------------- batching


def reference_greedy(src, tgt, max_tokens, max_sentences=None):
    """Obvious per-sentence implementation of the batching rule (no shuffle)."""
    order = sorted(range(len(src)), key=lambda i: (tgt[i], src[i], i))
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, src[i] + 1, tgt[i] + 1)
        full = max_sentences is not None and len(current) == max_sentences
        if current and ((len(current) + 1) * w > max_tokens or full):
            batches.append(current)
            current, w = [], max(src[i], tgt[i]) + 1
        current.append(i)
        width = w
    if current:
        batches.append(current)
    return batches


@pytest.mark.parametrize(
    ("max_tokens", "max_sentences"), [(64, None), (200, None), (200, 5), (1000, 7)]
)
def test_unshuffled_batches_match_reference_greedy(max_tokens, max_sentences):
    rng = np.random.default_rng(3)
    src, tgt = rng.integers(0, 40, 500), rng.integers(0, 40, 500)
    got = make_token_batches(src, tgt, max_tokens, max_sentences, shuffle=False)
    expected = reference_greedy(src.tolist(), tgt.tolist(), max_tokens, max_sentences)
    assert [b.tolist() for b in got] == expected


def test_lengths_beyond_uint16_sort_correctly():
    # Lengths over 65535 take the wide-key sort path instead of the 16-bit radix one.
    rng = np.random.default_rng(4)
    src, tgt = rng.integers(60_000, 70_000, 200), rng.integers(65_000, 66_000, 200)
    tgt[:50] = 65_500  # ties on the primary key
    got = make_token_batches(src, tgt, 300_000, shuffle=False)
    assert [b.tolist() for b in got] == reference_greedy(src.tolist(), tgt.tolist(), 300_000)


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [4, 13, 257, 1000])
def test_batches_cover_every_index_once_within_budget(n, num_replicas):
    rng = np.random.default_rng(n)
    src, tgt = rng.integers(0, 60, n), rng.integers(0, 60, n)
    max_tokens = 150
    batches = make_token_batches(src, tgt, max_tokens, max_sentences=9, seed=5, epoch=2,
                                 required_multiple=num_replicas)
    assert len(batches) % num_replicas == 0
    assert all(0 < len(b) <= 9 for b in batches)
    assert all(batch_cost(src, tgt, b) <= max_tokens for b in batches)
    everything = np.concatenate(batches)
    assert len(everything) == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))
    per_rank = [batches[r::num_replicas] for r in range(num_replicas)]
    assert len({len(p) for p in per_rank}) == 1


def test_required_multiple_splits_largest_batches():
    # 4 sentences per batch by budget: 10 sentences -> batches of 4, 4, 2.
    sizes = np.full(10, 9)
    assert [len(b) for b in make_token_batches(sizes, sizes, 40, shuffle=False)] == [4, 4, 2]
    # One split needed: the first of the largest batches is halved in place.
    split = make_token_batches(sizes, sizes, 40, shuffle=False, required_multiple=4)
    assert [len(b) for b in split] == [2, 2, 4, 2]
    np.testing.assert_array_equal(np.concatenate(split), np.arange(10))
    # Five splits needed, always halving the earliest of the largest batches.
    split = make_token_batches(sizes, sizes, 40, shuffle=False, required_multiple=8)
    assert [len(b) for b in split] == [1, 1, 1, 1, 1, 1, 2, 2]


def test_required_multiple_errors_when_impossible():
    sizes = np.full(3, 5)
    with pytest.raises(ValueError, match="3 sentences"):
        make_token_batches(sizes, sizes, 100, required_multiple=4)
    # Enough sentences, but each already fills a batch on its own.
    with pytest.raises(ValueError, match="ranks"):
        make_token_batches(np.full(5, 9), np.full(5, 9), 10, required_multiple=4)


def test_batches_are_deterministic_and_epoch_changes_order():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 50, 2000), rng.integers(1, 50, 2000)
    a = make_token_batches(src, tgt, 300, seed=1, epoch=1)
    b = make_token_batches(src, tgt, 300, seed=1, epoch=1)
    c = make_token_batches(src, tgt, 300, seed=1, epoch=2)
    d = make_token_batches(src, tgt, 300, seed=2, epoch=1)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    assert [x.tolist() for x in a] != [x.tolist() for x in d]
    # Shuffling reorders batches but sorting still keeps lengths homogeneous.
    lengths_by_position = [int(tgt[x].max()) for x in a]
    assert lengths_by_position != sorted(lengths_by_position)
    assert all(int(tgt[x].max()) - int(tgt[x].min()) <= 1 for x in a)


def test_over_long_sentence_is_reported():
    src = np.array([3, 4, 50, 2, 70])
    tgt = np.array([3, 4, 5, 2, 6])
    with pytest.raises(ValueError, match=r"sentence 2 .*length 50.*max_tokens=40"):
        make_token_batches(src, tgt, 40)


@pytest.mark.parametrize("max_positions", [10, (10, 5), (None, 7), (8, None), None])
def test_filter_by_size_matches_loop(max_positions):
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(0, 15, 300), rng.integers(0, 15, 300)
    pair = max_positions if isinstance(max_positions, tuple) else (max_positions, max_positions)
    limit = [float("inf") if m is None else m for m in pair]
    expected = [i for i in range(300) if src[i] + 1 <= limit[0] and tgt[i] + 1 <= limit[1]]
    kept, dropped = filter_by_size(src, tgt, max_positions)
    assert kept.tolist() == expected
    assert dropped == 300 - len(expected)


def test_indices_argument_batches_subset_by_dataset_index():
    src = np.array([1, 100, 2, 3])
    tgt = np.array([1, 1, 2, 3])
    batches = make_token_batches(src, tgt, 50, shuffle=False, indices=[0, 2, 3])
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), [0, 2, 3])


# --------------------------------------------------------------------------- iterator


def take(iterator, k):
    return [iterator.next_batch() for _ in range(k)]


def same_batches(a, b):
    return len(a) == len(b) and all(
        all(torch.equal(x[key], y[key]) for key in ("ids", "src_tokens", "tgt_in_tokens", "target"))
        for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def pair_dataset(tmp_path_factory):
    return make_parallel(tmp_path_factory.mktemp("corpus"), 300, max_len=25)


def test_iterator_batches_hold_the_dataset_contents(pair_dataset):
    it = EpochBatchIterator(pair_dataset, 200, PAD, EOS, seed=3)
    for batch in take(it, it.batches_per_epoch):
        assert batch["src_tokens"].numel() <= 200 and batch["target"].numel() <= 200
        for row, index in enumerate(batch["ids"].tolist()):
            src, tgt = pair_dataset[index]
            np.testing.assert_array_equal(batch["src_tokens"][row, : len(src)].numpy(), src)
            np.testing.assert_array_equal(batch["target"][row, : len(tgt)].numpy(), tgt)


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_iterator_ranks_partition_each_epoch(pair_dataset, num_replicas):
    iterators = [
        EpochBatchIterator(pair_dataset, 160, PAD, EOS, seed=1, num_replicas=num_replicas,
                           rank=r, max_positions=20)
        for r in range(num_replicas)
    ]
    counts = {it.batches_per_epoch for it in iterators}
    assert len(counts) == 1
    seen = [
        i for it in iterators for b in take(it, it.batches_per_epoch) for i in b["ids"].tolist()
    ]
    kept, dropped = filter_by_size(pair_dataset.src_sizes, pair_dataset.tgt_sizes, 20)
    assert dropped > 0 and iterators[0].dropped == dropped
    assert sorted(seen) == kept.tolist()
    assert all(it.epoch == 1 for it in iterators)
    iterators[0].next_batch()
    assert iterators[0].epoch == 2


def test_iterator_rolls_over_with_new_shuffle(pair_dataset):
    it = EpochBatchIterator(pair_dataset, 200, PAD, EOS)
    first = [b["ids"].tolist() for b in take(it, it.batches_per_epoch)]
    second = [b["ids"].tolist() for b in take(it, it.batches_per_epoch)]
    assert it.epoch == 2
    assert first != second
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(len(pair_dataset)))


def test_iterator_peek_returns_the_next_batch_without_consuming_it(pair_dataset):
    """The profiling batch is peeked from the training iterator: it must be the batch a fresh
    iterator draws first, and training must still start with it."""
    kwargs = dict(seed=5, num_replicas=2, rank=1, max_positions=20)
    fresh = take(EpochBatchIterator(pair_dataset, 160, PAD, EOS, **kwargs), 3)
    it = EpochBatchIterator(pair_dataset, 160, PAD, EOS, **kwargs)
    assert same_batches([it.peek_batch(), it.peek_batch()], fresh[:1] * 2)
    assert it.position == 0
    assert same_batches(take(it, 3), fresh)
    take(it, it.batches_per_epoch - 3)
    with pytest.raises(IndexError, match="epoch 1 is exhausted"):
        it.peek_batch()


@pytest.mark.parametrize("stop_offset", [-3, 0, 2])
def test_iterator_resume_matches_uninterrupted_run(pair_dataset, stop_offset):
    # stop_offset is relative to the end of epoch 1: mid-epoch, exactly at the
    # boundary, and just after rolling into epoch 2.
    kwargs = dict(seed=7, num_replicas=2, rank=1)
    reference = EpochBatchIterator(pair_dataset, 200, PAD, EOS, **kwargs)
    stop = reference.batches_per_epoch + stop_offset
    expected = take(reference, stop + reference.batches_per_epoch + 3)[stop:]

    interrupted = EpochBatchIterator(pair_dataset, 200, PAD, EOS, **kwargs)
    take(interrupted, stop)
    state = interrupted.state_dict()
    assert set(state) == {"epoch", "position", "seed", "num_replicas"}

    resumed = EpochBatchIterator(pair_dataset, 200, PAD, EOS, seed=0, num_replicas=2, rank=1)
    resumed.batches_per_epoch  # builds epoch 1 with seed 0; loading must discard it
    resumed.load_state_dict(state)
    assert resumed.seed == 7 and resumed.epoch == state["epoch"]
    assert same_batches(take(resumed, len(expected)), expected)


def test_iterator_resume_with_different_world_size(pair_dataset):
    old = EpochBatchIterator(pair_dataset, 200, PAD, EOS, num_replicas=2, rank=0)
    take(old, 4)
    new = EpochBatchIterator(pair_dataset, 200, PAD, EOS, num_replicas=4, rank=3)
    new.load_state_dict(old.state_dict())
    assert new.epoch == 1 and new.position == 2  # 4 batches x 2 ranks = 8 global = 2 x 4 ranks
    new.next_batch()
    assert new.position == 3


def test_iterator_rejects_state_beyond_epoch(pair_dataset):
    it = EpochBatchIterator(pair_dataset, 200, PAD, EOS)
    with pytest.raises(ValueError, match="position"):
        it.load_state_dict({"epoch": 1, "position": it.batches_per_epoch + 1, "seed": 0,
                            "num_replicas": 1})


def test_iterator_dunder_iter_is_endless(pair_dataset):
    it = EpochBatchIterator(pair_dataset, 400, PAD, EOS, max_sentences=50)
    n = it.batches_per_epoch
    for k, _ in enumerate(iter(it)):
        if k == 2 * n + 1:
            break
    assert it.epoch == 3 and it.position == 2
