"""Format 3's range coding (compressor/entropy.py, compressor/dcz3.py): models against hand
computations, round trips, the mode choices, and crafted format-3 files."""

from __future__ import annotations

import math
import struct
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from compresskit.compressor import archive, dcz3, entropy
from compresskit.compressor.shrink import bits_equal
from compresskit.models import InputError

SPEC = {"name": "x", "kwargs": {}}


def _sequential_kt_bits(ctx, sym, k):
    """The KT adaptive code length, one symbol at a time: -log2((c_s + 1/2) / (n + k/2))."""
    counts: dict[int, np.ndarray] = {}
    bits = 0.0
    for c, s in zip(ctx, sym, strict=True):
        n = counts.setdefault(int(c), np.zeros(k))
        bits -= math.log2((n[s] + 0.5) / (n.sum() + k / 2))
        n[s] += 1
    return bits


def test_adaptive_bits_is_the_sequential_kt_code_length():
    g = np.random.default_rng(0)
    sym = g.integers(0, 5, 300)
    ctx = g.integers(0, 3, 300)
    assert entropy.adaptive_bits(ctx, sym, 5) == pytest.approx(_sequential_kt_bits(ctx, sym, 5))
    assert entropy.adaptive_bits(np.zeros(0), np.zeros(0), 5) == 0.0


def test_iid_bits_by_hand():
    assert entropy.iid_bits(1, 4) == pytest.approx(-(math.log2(0.25) + 3 * math.log2(0.75)))
    assert entropy.iid_bits(0, 9) == entropy.iid_bits(9, 9) == 0.0


def _clustered(g, rows: int, cols: int, after_kept: float, after_pruned: float) -> np.ndarray:
    """A mask kept in runs along each row (a Markov chain per row): a neuron's receptive field
    on neighbouring pixels, as in LeNet-300-100's fc1."""
    mask = np.zeros((rows, cols), bool)
    for c in range(1, cols):
        mask[:, c] = g.random(rows) < np.where(mask[:, c - 1], after_kept, after_pruned)
    return mask


def _round_trip_shared(shape, positions, index, k):
    w = dcz3.Writer()
    codebook = np.linspace(-1, 1, k).astype(np.float32)
    modes, parts = w.shared(shape, codebook, index, positions)
    r = dcz3.Reader(w.words())
    cb, got_index, got_pos = r.shared(shape, k, len(index), modes)
    assert np.array_equal(cb, codebook)
    assert np.array_equal(got_pos, positions) and np.array_equal(got_index, index)
    return modes, parts  # bits of the codebook, the mask, the indices


def test_a_clustered_mask_gets_run_contexts_and_costs_less_than_iid():
    # Kept weights in runs along the input axis (a neuron's receptive field on neighbouring
    # pixels, as in LeNet-300-100's fc1): a Markov chain per row.
    g = np.random.default_rng(1)
    rows, cols = 60, 200
    mask = _clustered(g, rows, cols, 0.6, 0.05)
    positions = np.flatnonzero(mask.ravel())
    index = g.integers(0, 8, len(positions))
    modes, (_, mask_bits, _) = _round_trip_shared((rows, cols), positions, index, 8)
    assert modes[1] == entropy.MASK_RUNS
    assert mask_bits < 0.8 * entropy.iid_bits(len(positions), mask.size)


def test_correlated_neighbours_get_the_left_context():
    # Each row repeats its previous kept index 90 % of the time.
    g = np.random.default_rng(2)
    rows, cols, k = 40, 100, 16
    grid = np.zeros((rows, cols), np.int64)
    grid[:, 0] = g.integers(0, k, rows)
    for c in range(1, cols):
        keep = g.random(rows) < 0.9
        grid[:, c] = np.where(keep, grid[:, c - 1], g.integers(0, k, rows))
    positions = np.arange(rows * cols)  # every position kept: no mask is coded
    modes, (_, _, index_bits) = _round_trip_shared((rows, cols), positions, grid.ravel(), k)
    assert modes[1] == entropy.MASK_NONE and modes[2] == entropy.INDEX_LEFT
    assert index_bits < 0.6 * entropy.adaptive_bits(np.zeros(rows * cols), grid.ravel(), k)


def test_random_data_keeps_the_plain_models():
    g = np.random.default_rng(3)
    positions = np.sort(g.choice(5000, 400, replace=False))
    modes, _ = _round_trip_shared((50, 100), positions, g.integers(0, 32, 400), 32)
    assert modes[1:] == (entropy.MASK_IID, entropy.INDEX_ORDER0)


@pytest.mark.parametrize(
    "shape,n", [((7,), 3), ((1, 9), 4), ((9, 1), 9), ((4, 4), 0), ((3, 5, 2, 2), 60)]
)
def test_edge_shapes_round_trip(shape, n):
    g = np.random.default_rng(4)
    numel = math.prod(shape)
    positions = np.sort(g.choice(numel, n, replace=False))
    _round_trip_shared(shape, positions, g.integers(0, 3, n), 3)


def test_byte_planes_round_trip_and_share_models_across_tensors():
    g = np.random.default_rng(5)
    small = [torch.randn(32) * 0.1 for _ in range(20)]  # BatchNorm-sized vectors
    raw = [archive._raw(t) for t in small]
    w = dcz3.Writer()
    modes = [w.dense(r, 4) for r in raw]
    assert entropy.SHARED in modes[1:]  # later small tensors reuse what the first ones taught
    r = dcz3.Reader(w.words())
    assert [r.dense(4, 32, m) for m in modes] == raw
    # Shared models cost less than each tensor learning alone.
    alone = 0
    for x in raw:
        one = dcz3.Writer()
        one.dense(x, 4)
        alone += one.bits()
    assert w.bits() < alone
    ints = g.integers(-5, 5, 100).astype("<i8").tobytes()
    w2 = dcz3.Writer()
    m = w2.dense(ints, 8)
    assert dcz3.Reader(w2.words()).dense(8, 100, m) == ints


def test_encoding_is_deterministic_and_decodes_bit_for_bit():
    g = np.random.default_rng(6)
    positions = np.sort(g.choice(2000, 300, replace=False))
    codebook = np.sort(g.normal(size=31)).astype(np.float32)
    entries = [
        archive.Shared("a.weight", (40, 50), codebook, g.integers(0, 31, 300), positions, 5),
        archive.Dense("a.bias", torch.randn(40)),
        archive.Dense("bn.running_var", torch.rand(40) + 0.5, store_fp16=True),
    ]
    one, _ = archive.encode(entries, SPEC, {})
    two, _ = archive.encode(entries, SPEC, {})
    assert one == two
    out = archive.decode(one).state_dict
    assert bits_equal(out["a.bias"], entries[1].tensor)
    assert bits_equal(out["a.weight"], entries[0].weight())


# --- crafted format-3 files ------------------------------------------------------------------


def _v3(directory: list[bytes], words: bytes = b"", names=None) -> bytes:
    names = names or [f"t{i}" for i in range(len(directory))]
    header = dcz3.deflate(archive._header_text(SPEC, {}, names))
    body = (
        archive.MAGIC
        + struct.pack("<H", 3)
        + dcz3.varint(len(header))
        + header
        + dcz3.varint(len(directory))
        + b"".join(directory)
        + dcz3.varint(len(words) // 4)
        + words
    )
    return body + struct.pack("<I", zlib.crc32(body))


def _shared_dir(shape, k, n, modes=(0, 1, 0)):
    return dcz3.record_head(0, shape, dcz3.SHARED) + dcz3.shared_dir(k, n, modes)


def _refused(data: bytes, match: str, **kw) -> None:
    with pytest.raises(InputError, match=match):
        archive.decode(data, "crafted.dcz", **kw)


def test_a_tiny_archive_cannot_declare_a_huge_unchecked_tensor():
    """Range coding turns a few words into any number of elements: a 116-byte file decoded a
    2^27-element dense tensor in 36 s and 3.1 GB. With no model to check its shapes, the
    file's size bounds them (1,024 per byte past a floor of 2^22)."""
    dense = dcz3.record_head(0, (2**24,), dcz3.DENSE) + dcz3.dense_dir(0, 1)
    crafted = _v3([dense], bytes(16))
    start = time.perf_counter()
    _refused(crafted, "more elements than 1,024 per byte of the archive")
    assert time.perf_counter() - start < 1.0
    small = _v3([dcz3.record_head(0, (2**16,), dcz3.DENSE) + dcz3.dense_dir(0, 1)], bytes(16))
    _refused(small, "not in the form compress writes")  # under the floor: decoded, then judged


def test_crafted_directories_are_refused_before_decoding():
    _refused(_v3([_shared_dir((2**16, 2**15 + 1), 2, 1)]), "past 2,147,483,648 elements")
    _refused(_v3([_shared_dir((10,), 2, 11)]), "11 entries for 10 positions")
    _refused(_v3([_shared_dir((10,), 2**16, 3)]), "codebook of 65,536")
    _refused(_v3([_shared_dir((10,), 0, 3)]), "empty codebook")
    _refused(_v3([_shared_dir((10,), 2, 3, (0, 7, 0))]), "unknown mask mode 7")
    _refused(_v3([_shared_dir((10,), 2, 3, (0, 0, 0))]), "does not fit the count")
    _refused(_v3([_shared_dir((10,), 2, 3, (0, 1, 9))]), "unknown index mode 9")
    # Context modes loop over columns: a 1 x 2^20 record may not ask for them.
    _refused(_v3([_shared_dir((1, 2**20), 2, 3, (0, 2, 0))]), "more than 16,384 columns")
    _refused(_v3([_shared_dir((1, 2**20), 2, 3, (0, 1, 1))]), "more than 16,384 columns")
    _refused(_v3([_shared_dir((10,), 2, 3, (5, 1, 0))]), "unknown plane model 5")
    dense = dcz3.record_head(0, (3,), dcz3.DENSE)
    _refused(_v3([dense + bytes([4, 0])]), "stored as")  # float32 stored as int64
    _refused(_v3([dense + bytes([0, 2])]), "unknown plane model 2")
    _refused(_v3([dcz3.record_head(0, (3,), 9)]), "unknown encoding 9")
    _refused(_v3([_shared_dir((10,), 2, 3)], b"\0\0\0"), "not 0 words|holds 3 bytes")
    # A count of tensors the file cannot hold, and a 10-byte varint.
    body = bytearray(_v3([])[:-4])
    body[-2] = 0xFF  # the tensor count's varint now continues into the word count
    _refused(bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))), "crafted.dcz")


def test_any_change_to_the_stream_is_refused():
    g = np.random.default_rng(7)
    positions = np.sort(g.choice(600, 80, replace=False))
    codebook = np.linspace(-1, 1, 8).astype(np.float32)
    e = archive.Shared("t0", (20, 30), codebook, g.integers(0, 8, 80), positions, 4)
    data, _ = archive.encode([e], SPEC, {})
    w = dcz3.Writer()
    archive._write_record_v3(w, e)
    first = len(data) - 4 - 4 * len(w.words())
    for i in range(first, len(data) - 4):
        for bit in (0, 7):
            body = bytearray(data[:-4])
            body[i] ^= 1 << bit
            crafted = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
            _refused(crafted, "damaged stream|not in the form compress writes")


def test_a_mask_that_miscounts_is_refused():
    # The directory says 5 entries; the stream was coded for 4. Whatever the decoder makes of
    # it, the file is refused, never read as some other model.
    w = dcz3.Writer()
    positions = np.arange(4)
    w.shared((1, 10), np.float32([1, 2]), np.zeros(4, int), positions)
    data = _v3([_shared_dir((1, 10), 2, 5)], w.words().astype("<u4").tobytes())
    _refused(data, "damaged stream|not in the form compress writes")


def test_a_file_in_modes_this_encoder_would_not_choose_still_reads():
    # The encoder's heuristics may change between releases; a file names its modes, and the
    # reader checks the stream against those, not against what it would choose today.
    g = np.random.default_rng(8)
    mask = _clustered(g, 30, 120, 0.7, 0.05)
    positions = np.flatnonzero(mask.ravel())
    e = archive.Shared(
        "t0",
        (30, 120),
        np.linspace(-1, 1, 4).astype(np.float32),
        g.integers(0, 4, len(positions)),
        positions,
        4,
    )
    chosen, _ = archive.encode([e], SPEC, {})
    d = archive.decode(chosen, keep_entries=True)
    assert d.modes[0][1] == entropy.MASK_RUNS
    plain, _ = archive.encode([e], SPEC, {}, modes=[(d.modes[0][0], entropy.MASK_IID, 0)])
    assert len(plain) > len(chosen)
    back = archive.decode(plain, keep_entries=True)
    assert back.modes[0][1] == entropy.MASK_IID
    assert bits_equal(back.state_dict["t0"], d.state_dict["t0"])


def test_review_crafted_cases_are_one_line_refusals():
    # A 0-d shared record asking for a context mode (was IndexError), a tensor named twice
    # (format 2 refuses it; format 3 let the second replace the first), left-neighbour contexts
    # for a codebook the encoder never writes them for (a slow decode from a small file).
    _refused(_v3([_shared_dir((), 2, 0, (0, 1, 1))]), "crafted.dcz")
    _refused(_v3([_shared_dir((), 2, 0, (0, 2, 0))]), "crafted.dcz")
    named = [_shared_dir((4,), 2, 0, (0, 1, 0))] * 2
    _refused(_v3(named, names=["a", "a"]), "'a' appears twice")
    _refused(_v3([_shared_dir((8, 16), 4096, 3, (0, 1, 1))]), "at most 256")


def test_empty_tensors_compare_and_round_trip():
    entries = [archive.Dense("e", torch.zeros(0)), archive.Dense("f", torch.zeros(5, 0, 3))]
    for version in (2, 3):
        out = archive.decode(archive.encode(entries, SPEC, {}, version)[0]).state_dict
        assert all(bits_equal(out[e.name], e.tensor) for e in entries)


GOLDEN_V3 = Path(__file__).parent / "golden" / "v3.dcz"


def _golden_entries():
    g = np.random.default_rng(11)
    mask = _clustered(g, 24, 40, 0.6, 0.1)
    positions = np.flatnonzero(mask.ravel())
    codebook = np.sort(g.normal(size=15)).astype(np.float32)
    return [
        archive.Shared(
            "fc.weight", (24, 40), codebook, g.integers(0, 15, len(positions)), positions, 4
        ),
        archive.Dense("fc.bias", torch.from_numpy(g.normal(size=24).astype(np.float32))),
        archive.Dense("bn.running_var", torch.tensor([0.5, 1.25, 2.0]), store_fp16=True),
        archive.Dense("bn.num_batches_tracked", torch.tensor(7)),
    ]


def test_a_format_3_file_of_record_still_reads_byte_for_byte():
    # Fixed bytes written at the format's introduction (2026-11-25): a constriction release or
    # platform that quantized probabilities differently would fail here, not on users' files.
    data = GOLDEN_V3.read_bytes()
    d = archive.decode(data, keep_entries=True)
    assert d.version == 3
    for e in _golden_entries():
        want = e.weight() if isinstance(e, archive.Shared) else e.tensor
        assert bits_equal(d.state_dict[e.name], want), e.name
    assert archive.encode(d.entries, d.spec, d.metadata, 3, d.modes)[0] == data


def test_the_pricing_context_prices_as_the_whole_writer_would():
    # ArchiveContext.add codes only what later records depend on (byte-plane models); every
    # record must still be priced as if everything before it had been written in full.
    entries = _golden_entries() + _golden_entries()
    entries = [replace(e, name=f"{e.name}.{i}") for i, e in enumerate(entries)]
    context, as_written = archive.ArchiveContext(), archive.ArchiveContext()
    full = as_written.writer  # written in full below, not through `add`
    for e in entries:
        assert archive.record_size(e, context=context) == archive.record_size(
            e, context=as_written
        ), e.name
        context.add(e)
        archive._write_record_v3(full, e)


def test_a_dense_records_estimate_is_within_bytes_of_coding_it_and_changes_nothing():
    """`archive.dense_size_estimate` prices a dense record from its planes' code length under
    the same models, without a range coder: what `archive.sizes` trusts when it is plainly
    the larger of two records."""
    g = torch.Generator().manual_seed(0)
    levels = torch.linspace(-0.1, 0.1, 16)
    tensors = {
        "normal": torch.randn(200_000, generator=g) * 0.02,
        "fp16-exact": (torch.randn(50_000, generator=g) * 0.05).half().float(),
        "bn": torch.rand(64, generator=g) + 0.5,
        "zeros": torch.zeros(10_000),
        "shared": levels[torch.randint(0, 16, (30_000,), generator=g)],
    }
    context = archive.ArchiveContext(3)
    context.add(archive.Dense("before", torch.randn(5_000, generator=g), store_fp16=False))
    before = {k: [m.counts.copy() for m in ms] for k, ms in context.writer.planes.models.items()}
    for name, t in tensors.items():
        for fp16 in (False, True):
            for ctx in (None, context):
                e = archive.Dense(name, t, store_fp16=fp16)
                exact = archive.record_size(e, 3, ctx)
                guess = archive.dense_size_estimate(e, ctx)
                # Never more than the flush over the coded size, and close to it.
                assert exact - 1e-4 * exact - 8 <= guess <= exact + 8, (name, fp16, exact, guess)
    after = context.writer.planes.models
    assert before.keys() == after.keys()
    assert all(
        np.array_equal(a, m.counts)
        for k in before
        for a, m in zip(before[k], after[k], strict=True)
    )


@pytest.mark.parametrize("seen_log2", [24, 26])
def test_a_dense_estimate_never_overprices_rare_symbols_after_millions_of_values(seen_log2):
    """After 2^24 values of a few levels through the archive's float32 models, a tensor of
    those levels with a few perturbed values has rare symbols the coder prices at its 24-bit
    floor: an estimate at -log2 p came out 59 B over the coded 3,931 B, enough to call dense
    plainly larger against a shared record of 3,932 B. Priced at the coder's floor it is not."""
    g = np.random.default_rng(0)
    levels = (g.standard_normal(16) * 0.05).astype(np.float32)
    base = entropy.planes_of(levels[g.integers(0, 16, 4096)].astype("<f4").tobytes(), 4)
    base = base.astype(np.int64)
    scale = 2**seen_log2 // 4096
    models = entropy._fresh(4)
    for j in (0, 2, 3):
        models[j].counts[0] = np.bincount(base[j], minlength=256) * scale
    np.add.at(models[1].counts, (base[0], base[1]), scale)
    context = archive.ArchiveContext(3)
    context.writer.planes.models[("dense:0", 4)] = models
    for perturbed in (110, 130, 150):
        values = levels[g.integers(0, 16, 2000)]
        values[:perturbed] *= (1 + g.uniform(-0.4, 0.4, perturbed)).astype(np.float32)
        e = archive.Dense("x", torch.from_numpy(values), store_fp16=False)
        exact = archive.record_size(e, 3, context)
        assert archive.dense_size_estimate(e, context) <= exact + 8
        # A shared rival one byte larger: exact pricing stores dense, and so must this.
        assert archive.dense_size(e, exact + 1, 3, context) == (exact, False)


def test_a_fresh_writer_keeps_its_winning_trial_as_coding_again_would():
    """A writer that has coded nothing keeps the winning trial's coder and models
    (`Planes.encode_first`) instead of coding the planes a third time: the same stream and the
    same models as `Planes.encode` into a fresh coder, for either mode winning."""
    g = np.random.default_rng(0)
    warm = g.standard_normal(20_000).astype("<f4").tobytes()
    tensors = {
        "like the archive": g.standard_normal(5_000).astype("<f4").tobytes(),  # SHARED wins
        "unlike it": (np.arange(5_000) % 7).astype("<f4").tobytes(),  # OWN wins
    }
    for name, raw in tensors.items():
        kept, coded = dcz3.Writer(), dcz3.Writer()
        for w in (kept, coded):
            w.dense(warm, 4)
            w.drop_stream()
        mode = kept.dense(raw, 4)
        enc = entropy.RangeEncoder()
        assert coded.planes.encode(enc, entropy.planes_of(raw, 4), "dense:0") == mode, name
        assert np.array_equal(kept.words(), np.asarray(enc.get_compressed(), "<u4")), name
        ours, theirs = kept.planes.models[("dense:0", 4)], coded.planes.models[("dense:0", 4)]
        for a, b in zip(ours, theirs, strict=True):
            assert np.array_equal(a.counts, b.counts), name
    modes = set()
    for raw in tensors.values():
        w = dcz3.Writer()
        w.dense(warm, 4)
        w.drop_stream()
        modes.add(w.dense(raw, 4))
    assert modes == {entropy.SHARED, entropy.OWN}  # both paths taken


@pytest.mark.parametrize("block", [1, 120, 1000, 1 << 30])  # rows: 1, 2, 20 of 37, all
def test_the_mode_choices_count_in_row_blocks_what_the_whole_layer_gives(monkeypatch, block):
    # The estimates are counted a block of rows at a time to bound memory on big layers; any
    # block size (one row, blocks that do not divide the rows, the whole layer) must give the
    # code length of the contexts computed over the whole layer at once.
    g = np.random.default_rng(5)
    rows, cols, k = 37, 50, 16
    mask = _clustered(g, rows, cols, 0.6, 0.05)
    index = g.integers(0, k, int(mask.sum()))
    grid = np.full((rows, cols), -1, np.int64)
    grid[mask] = index
    left = np.concatenate([np.full((rows, 1), -1), grid[:, :-1]], axis=1)[mask]
    col = np.arange(cols)[None, :]
    last = np.maximum.accumulate(np.where(mask, col, -1), axis=1)
    before = np.concatenate([np.full((rows, 1), -1), last[:, :-1]], axis=1)
    zeros = col - before - 1 + (before < 0)
    prev = np.concatenate([np.zeros((rows, 1), bool), mask[:, :-1]], axis=1)
    runs = np.where(prev, 0, np.minimum(np.floor(np.log2(np.maximum(zeros, 1))) + 1, 12))
    monkeypatch.setattr(entropy, "CHOOSE_BLOCK", block)
    assert entropy.run_context_bits(mask) == pytest.approx(
        entropy.adaptive_bits(runs, mask, 2), rel=1e-12
    )
    buckets = np.where(left < 0, entropy.LEFT_BUCKETS, (np.maximum(left, 0) * 8) // k)
    assert entropy.left_context_bits(mask, index, k) == pytest.approx(
        entropy.adaptive_bits(buckets, index, k), rel=1e-12
    )
