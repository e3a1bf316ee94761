"""Adaptive context-model range coding of a weight-shared layer: the `.dcz` format 3 streams.

Deep Compression (Han, Mao & Dally, ICLR 2016, section 4) Huffman-codes the cluster indices and
the relative positions of the kept weights, each with a code table stored beside it. Measured on
our archives (docs/archive-format.md), that leaves three costs a generic compressor does not pay:
the tables themselves (up to 2^b bytes per gap alphabet, k per codebook), Huffman's whole-bit
floor on skewed alphabets, and raw float32 codebooks and dense tensors, whose sign/exponent
bytes brotli squeezes by 12-23 %. Format 3 replaces all three with arithmetic (range) coding
under adaptive models, the approach of CABAC and of context-mixing compressors:

* no tables: every model starts from a Krichevsky-Trofimov prior (counts of 1/2) and learns its
  counts as it codes, so the decoder rebuilds the same model from the symbols it has decoded;
* positions as a binary mask, coded column by column (one input feature across every output
  row), the context of a bit being how many zeros precede it in its row. Pruned inputs are
  pruned for every row (MNIST's border pixels in LeNet-300-100's fc1): 11,825 -> 9,824 bytes.
  Where contexts buy nothing, one i.i.d. model with p = kept / positions, known from the count;
* cluster indices either order-0, or conditioned on the left neighbour's index (the previous
  input feature of the same row: neighbouring pixels' weights correlate, 10,217 -> 9,194 bytes
  on that fc1);
* floats split into byte planes, most significant first: the sign/exponent plane order-0, the
  next conditioned on it, the low mantissa planes order-0 or uniform.

Each choice is made per tensor by the encoder from closed-form code lengths (`adaptive_bits`)
and written as a mode byte, so the decoder never guesses. Models update between *steps* (a
column, or a growing block of symbols), not after every symbol: within a step all symbols are
coded in one call to the range coder, grouped by context, which keeps decoding in compiled code
(`constriction`, Bamler 2022) instead of a Python loop per symbol.

Every probability is an integer count plus one half, passed as float64 (exact), so encoder and
decoder see bit-identical models on any CPU.
"""

from __future__ import annotations

import numpy as np
from constriction import stream
from scipy.special import gammaln

# constriction's modules are attributes of its compiled extension, not importable submodules.
Categorical = stream.model.Categorical
RangeEncoder, RangeDecoder = stream.queue.RangeEncoder, stream.queue.RangeDecoder

# Modes, as stored (one byte each). A decoder refuses any other value.
MASK_NONE, MASK_IID, MASK_RUNS = 0, 1, 2  # every position kept / i.i.d. / zero-run contexts
INDEX_ORDER0, INDEX_LEFT = 0, 1  # cluster indices: order-0 / left neighbour's index bucket
SHARED, OWN = 0, 1  # byte planes: the archive's models for this dtype / this tensor's own

RUN_CONTEXTS = 13  # 0: left bit kept; 1 + floor(log2(zeros before)), capped
LEFT_BUCKETS = 8  # left neighbour's index in 8 value buckets, plus "left is pruned"
FIRST_STEP, GROWTH = 64, 1.25  # order-0 block sizes: 64, 80, 100, ... symbols
# Context modes step once per column, in Python: a reader bounds that loop (a crafted 1 x 2^31
# shape would otherwise run for hours). 16,384 inputs per output unit cover every layer in our zoo
# and a 7B-parameter transformer's MLP (11,008); wider layers get the plain modes.
MAX_CONTEXT_COLUMNS = 1 << 14
# Left-neighbour index contexts build up to LEFT_BUCKETS + 1 models per column; with codebooks of
# at most 256 values (8 bits) each is cheap. Larger codebooks use the order-0 model.
MAX_CONTEXT_K = 256
# A context model must promise 0.5 % fewer bits to be picked (the estimate assumes updates
# after every symbol; the coder updates per step). An encoder's choice, not part of the format:
# readers take whatever modes a file's directory names.
CHOOSE_MARGIN = 0.995
MASK_PRIOR = 16  # pseudo-counts of the mask's density in every zero-run context
QUANT_BITS = 24  # constriction's default precision for Categorical(perfect=False)


def adaptive_bits(ctx: np.ndarray, sym: np.ndarray, k: int) -> float:
    """Code length (bits) of `sym` under per-context adaptive KT models over k symbols, updated
    after every symbol: the closed form sum over contexts of log Gamma ratios. The coder, which
    updates per step, pays a little more; this ranks models."""
    ctx = np.asarray(ctx).ravel()
    if ctx.size == 0:
        return 0.0
    return kt_bits(joint_counts(ctx, sym, k, int(ctx.max()) + 1))


def joint_counts(ctx: np.ndarray, sym: np.ndarray, k: int, contexts: int) -> np.ndarray:
    """(contexts, k) counts of each (context, symbol) pair: `kt_bits`' input, which adds up
    over parts of a tensor (the mode choices count a big layer a block of rows at a time)."""
    ctx, sym = np.asarray(ctx).ravel(), np.asarray(sym).ravel()
    joint = np.bincount(ctx.astype(np.int64) * k + sym, minlength=contexts * k)
    return joint.reshape(contexts, k)


def kt_bits(joint: np.ndarray) -> float:
    """`adaptive_bits` from the counts `joint_counts` gives."""
    k = joint.shape[1]
    tot = joint.sum(1)
    used = tot > 0
    nats = (gammaln(tot[used] + 0.5 * k) - gammaln(0.5 * k)).sum() - (
        gammaln(joint[used] + 0.5) - gammaln(0.5)
    ).sum()
    return float(nats / np.log(2))


def iid_bits(n: int, total: int) -> float:
    """Bits of a binary mask with n ones among total positions under p = n / total."""
    if n in (0, total):
        return 0.0
    p = n / total
    return float(-(n * np.log2(p) + (total - n) * np.log2(1 - p)))


def _steps(n: int) -> list[tuple[int, int]]:
    out, start, size = [], 0, FIRST_STEP
    while start < n:
        out.append((start, min(n, start + int(size))))
        start, size = out[-1][1], size * GROWTH
    return out


class _Model:
    """Adaptive counts per context; codes one step at a time, grouped by context."""

    def __init__(self, k: int, contexts: int = 1) -> None:
        self.k = k
        self.counts = np.zeros((contexts, k), np.int64)

    def copy(self) -> _Model:
        twin = _Model(self.k, 1)
        twin.counts = self.counts.copy()
        return twin

    def _probs(self, c: int) -> Categorical:
        return Categorical(self.counts[c] * 2.0 + 1.0, perfect=False)

    def encode(self, enc: RangeEncoder, sym: np.ndarray, ctx: np.ndarray | None = None) -> None:
        if sym.size == 0:
            return
        if ctx is None:
            enc.encode(sym.astype(np.int32), self._probs(0))
            self.counts[0] += np.bincount(sym, minlength=self.k)
            return
        for c in np.unique(ctx):
            enc.encode(sym[ctx == c].astype(np.int32), self._probs(int(c)))
        np.add.at(self.counts, (ctx, sym), 1)

    def bits(self, sym: np.ndarray, ctx: np.ndarray | None = None) -> float:
        """A lower bound, to a fraction of a bit a symbol, of what `encode` spends on this
        step's symbols, then the same update. constriction's leaky quantizer gives a symbol of
        probability p at least ceil(p 2^24) + 1 of 2^24, at most p 2^24 + 2: priced so, a rare
        symbol never costs more than the coder pays for it (over 2^20 values in one model,
        exact -log2 p would overprice it). By counts, not symbol by symbol."""
        if sym.size == 0:
            return 0.0
        flat = sym if ctx is None else ctx * self.k + sym
        seen = np.bincount(flat, minlength=self.counts.size)
        # Priced only where this step has symbols: a context model's table is 256 x 256, and
        # most steps touch a small part of it.
        at = np.flatnonzero(seen)
        total = self.counts.sum(1) * 2.0 + self.k  # each context's weights, as `_probs`
        p = (self.counts.reshape(-1)[at] * 2.0 + 1.0) / total[at // self.k]
        cost = QUANT_BITS - np.log2(p * 2.0**QUANT_BITS + 2.0)
        self.counts += seen.reshape(self.counts.shape)
        return float(seen[at] @ cost)

    def decode(self, dec: RangeDecoder, n: int, ctx: np.ndarray | None = None) -> np.ndarray:
        if n == 0:
            return np.zeros(0, np.int64)
        if ctx is None:
            sym = np.asarray(dec.decode(self._probs(0), n), np.int64)
            self.counts[0] += np.bincount(sym, minlength=self.k)
            return sym
        sym = np.empty(n, np.int64)
        for c in np.unique(ctx):
            at = ctx == c
            sym[at] = dec.decode(self._probs(int(c)), int(at.sum()))
        np.add.at(self.counts, (ctx, sym), 1)
        return sym


def _order0_encode(enc: RangeEncoder, sym: np.ndarray, k: int) -> None:
    model = _Model(k)
    for a, b in _steps(len(sym)):
        model.encode(enc, sym[a:b])


def _order0_decode(dec: RangeDecoder, n: int, k: int) -> np.ndarray:
    model = _Model(k)
    return np.concatenate([model.decode(dec, b - a) for a, b in _steps(n)] or [np.zeros(0, int)])


# --- positions: a binary mask, column by column --------------------------------------------


def _run_context(left_kept: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    bucket = np.floor(np.log2(np.maximum(zeros, 1))).astype(np.int64) + 1
    return np.where(left_kept, 0, np.minimum(bucket, RUN_CONTEXTS - 1))


def _run_contexts_all(mask: np.ndarray) -> np.ndarray:
    """Every position's zero-run context, for the mode choice (rows x cols mask)."""
    rows, cols = mask.shape
    col = np.arange(cols, dtype=np.int32)[None, :]
    last = np.maximum.accumulate(np.where(mask, col, np.int32(-1)), axis=1)
    before = np.concatenate([np.full((rows, 1), -1, np.int32), last[:, :-1]], axis=1)
    del last
    left = np.concatenate([np.zeros((rows, 1), bool), mask[:, :-1]], axis=1)
    # As the coder counts: a row starts as if one zero preceded it.
    return _run_context(left, col - before - 1 + (before < 0))


# Positions a mode choice looks at in one go: its arrays of contexts stay a few MB whatever the
# layer. Whole, a 2.36M-weight ResNet-18 conv made ~110 MiB of int64/float64 temporaries.
CHOOSE_BLOCK = 1 << 18


def _row_blocks(mask: np.ndarray):
    """`mask` a block of rows at a time, CHOOSE_BLOCK positions or one row."""
    step = max(1, CHOOSE_BLOCK // max(mask.shape[1], 1))
    for r in range(0, mask.shape[0], step):
        yield mask[r : r + step]


def run_context_bits(mask: np.ndarray) -> float:
    """`adaptive_bits` of the mask under its zero-run contexts, counted a block of rows at a
    time (contexts run along rows, so blocks count independently)."""
    joint = np.zeros((RUN_CONTEXTS, 2), np.int64)
    for part in _row_blocks(mask):
        joint += joint_counts(_run_contexts_all(part), part.astype(np.int8), 2, RUN_CONTEXTS)
    return kt_bits(joint)


def choose_mask(mask: np.ndarray) -> int:
    """The mask mode that codes `mask` (rows x cols, bool) in the fewest bits. The estimate
    only shortlists: the coder updates once per column, which costs a layer of few columns and
    many rows far more than the estimate says (300 x 64: 11 %), so a shortlisted context
    model is coded for real and kept only if it wins."""
    n, total = int(mask.sum()), mask.size
    if n == total:
        return MASK_NONE
    iid = iid_bits(n, total)
    if not 2 <= mask.shape[1] <= MAX_CONTEXT_COLUMNS:
        return MASK_IID
    if run_context_bits(mask) >= CHOOSE_MARGIN * iid:
        return MASK_IID
    trial = {}
    for mode in (MASK_IID, MASK_RUNS):
        scratch = RangeEncoder()
        encode_mask(scratch, mask, mode)
        trial[mode] = scratch.num_bits()
    return MASK_RUNS if trial[MASK_RUNS] < trial[MASK_IID] else MASK_IID


def _mask_model(n: int, total: int) -> _Model:
    """Zero-run context models, each started from the mask's known density (PRIOR pseudo-
    counts, integers from n and total, so the decoder starts from the same): a first column
    costs what an i.i.d. model would, not a bit per position."""
    model = _Model(2, RUN_CONTEXTS)
    kept = (n * MASK_PRIOR) // max(total, 1)
    model.counts[:, 1], model.counts[:, 0] = kept, MASK_PRIOR - kept
    return model


def encode_mask(enc: RangeEncoder, mask: np.ndarray, mode: int) -> None:
    """Code `mask` (rows x cols, bool; its count of kept positions is stored elsewhere)."""
    if mode == MASK_NONE:
        return
    n, total = int(mask.sum()), mask.size
    if mode == MASK_IID:
        if 0 < n < total:
            enc.encode(
                mask.ravel().astype(np.int32),
                Categorical(np.array([total - n, n], float), perfect=False),
            )
        return
    rows, cols = mask.shape
    model = _mask_model(n, total)
    left, zeros = np.zeros(rows, bool), np.ones(rows, np.int64)
    for c in range(cols):
        bit = mask[:, c]
        ctx = _run_context(left, zeros)
        enc.encode(bit.astype(np.int32), Categorical(perfect=False), model.counts[ctx] * 2.0 + 1.0)
        np.add.at(model.counts, (ctx, bit.astype(np.int64)), 1)
        zeros = np.where(bit, 0, zeros + 1)
        left = bit


def decode_mask(dec: RangeDecoder, rows: int, cols: int, n: int, mode: int) -> np.ndarray:
    total = rows * cols
    if mode == MASK_NONE:
        return np.ones((rows, cols), bool)
    if mode == MASK_IID:
        if n == 0:
            return np.zeros((rows, cols), bool)
        if n == total:
            return np.ones((rows, cols), bool)
        bits = dec.decode(Categorical(np.array([total - n, n], float), perfect=False), total)
        return np.asarray(bits, bool).reshape(rows, cols)
    mask = np.empty((rows, cols), bool)
    model = _mask_model(n, total)
    left, zeros = np.zeros(rows, bool), np.ones(rows, np.int64)
    for c in range(cols):
        ctx = _run_context(left, zeros)
        bit = np.asarray(
            dec.decode(Categorical(perfect=False), model.counts[ctx] * 2.0 + 1.0), np.int64
        )
        np.add.at(model.counts, (ctx, bit), 1)
        mask[:, c] = bit.astype(bool)
        zeros = np.where(mask[:, c], 0, zeros + 1)
        left = mask[:, c]
    return mask


# --- cluster indices -------------------------------------------------------------------------


def _left_bucket(left: np.ndarray, k: int) -> np.ndarray:
    """Context of an index: its left neighbour's index in LEFT_BUCKETS buckets (codebooks are
    sorted by value, so a bucket is a value range), or LEFT_BUCKETS when that one is pruned."""
    wide = np.maximum(left, 0).astype(np.int64)  # an int16 grid's values times 8 may not fit
    return np.where(left < 0, LEFT_BUCKETS, (wide * LEFT_BUCKETS) // max(k, 1))


def _index_grid(mask: np.ndarray, index: np.ndarray) -> np.ndarray:
    # The narrowest signed type that holds every index and the -1 of a pruned position
    grid = np.full(mask.shape, -1, np.int16 if index.size and index.max() < 2**15 else np.int64)
    grid[mask] = index  # row-major: the order entries are stored in
    return grid


def choose_index(mask: np.ndarray, index: np.ndarray, k: int) -> int:
    if (
        not 2 <= k <= MAX_CONTEXT_K
        or not index.size
        or not 2 <= mask.shape[1] <= MAX_CONTEXT_COLUMNS
    ):
        return INDEX_ORDER0
    order0 = kt_bits(np.bincount(index, minlength=k)[None, :])
    return (
        INDEX_LEFT if left_context_bits(mask, index, k) < CHOOSE_MARGIN * order0 else INDEX_ORDER0
    )


def left_context_bits(mask: np.ndarray, index: np.ndarray, k: int) -> float:
    """`adaptive_bits` of the indices under their left neighbour's bucket, counted a block of
    rows at a time (a left neighbour is in the same row)."""
    joint = np.zeros((LEFT_BUCKETS + 1, k), np.int64)
    done = 0
    for part in _row_blocks(mask):
        n = int(part.sum())
        idx = index[done : done + n]  # entries are stored row-major
        grid = _index_grid(part, idx)
        left = np.concatenate([np.full((part.shape[0], 1), -1, grid.dtype), grid[:, :-1]], 1)
        joint += joint_counts(_left_bucket(left[part], k), idx, k, LEFT_BUCKETS + 1)
        done += n
    return kt_bits(joint)


def encode_index(enc: RangeEncoder, mask: np.ndarray, index: np.ndarray, k: int, mode: int) -> None:
    """Code the entries' cluster indices (row-major order, as `mask` keeps them)."""
    if k < 2 or index.size == 0:
        return
    if mode == INDEX_ORDER0:
        _order0_encode(enc, index, k)
        return
    grid = _index_grid(mask, index)
    model = _Model(k, LEFT_BUCKETS + 1)
    left = np.full(mask.shape[0], -1, np.int64)
    for c in range(mask.shape[1]):
        kept = mask[:, c]
        model.encode(enc, grid[kept, c], _left_bucket(left[kept], k))
        left = grid[:, c]


def decode_index(dec: RangeDecoder, mask: np.ndarray, n: int, k: int, mode: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, np.int64)
    if k < 2:
        return np.zeros(n, np.int64)
    if mode == INDEX_ORDER0:
        return _order0_decode(dec, n, k)
    grid = np.full(mask.shape, -1, np.int64)
    model = _Model(k, LEFT_BUCKETS + 1)
    left = np.full(mask.shape[0], -1, np.int64)
    for c in range(mask.shape[1]):
        kept = mask[:, c]
        grid[kept, c] = model.decode(dec, int(kept.sum()), _left_bucket(left[kept], k))
        left = grid[:, c]
    return grid[mask]


# --- floats and other raw values: byte planes ----------------------------------------------


def planes_of(raw: bytes, itemsize: int) -> np.ndarray:
    """(itemsize, n) uint8 planes of little-endian values, most significant byte first."""
    a = np.frombuffer(raw, np.uint8).reshape(-1, itemsize)
    return np.ascontiguousarray(a[:, ::-1].T)


def bytes_of(planes: np.ndarray) -> bytes:
    return np.ascontiguousarray(planes.T[:, ::-1]).tobytes()


class Planes:
    """Byte-plane models shared by every tensor of one archive, keyed by (family, itemsize), the
    family naming the dtype: a model learns a dtype's sign/exponent statistics once, not once per 32-value BatchNorm
    vector (that is what lets brotli, which sees all tensors as one stream, win on small
    tensors). Plane 0 is coded order-0, plane 1 in the context of plane 0 (the exponent's low
    bit and the top mantissa bits depend on the exponent), lower planes order-0."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, int], list[_Model]] = {}

    def _models(self, family: str, itemsize: int) -> list[_Model]:
        key = (family, itemsize)
        if key not in self.models:
            self.models[key] = _fresh(itemsize)
        return self.models[key]

    @staticmethod
    def _steps(model: _Model, n: int) -> list[tuple[int, int]]:
        # Blocks grow with what the model has seen: early symbols update it often.
        out, start, seen = [], 0, int(model.counts.sum())
        while start < n:
            end = min(n, start + max(FIRST_STEP, seen // 4))
            out.append((start, end))
            seen += end - start
            start = end
        return out

    def _pieces(self, planes: np.ndarray, models: list[_Model]):
        """(model, symbols, contexts) of each step, in coding order: plane 1 in the context
        of plane 0. A plane's steps are cut before its model takes any of them."""
        for j, (p, model) in enumerate(zip(planes, models, strict=True)):
            # each step widened on its own: whole planes as int64 were 8 bytes a value at once
            for a, b in self._steps(model, p.size):
                ctx = planes[0, a:b].astype(np.int64) if j == 1 else None
                yield model, p[a:b].astype(np.int64), ctx

    def _code(self, enc, planes: np.ndarray, models: list[_Model]) -> None:
        for model, sym, ctx in self._pieces(planes, models):
            model.encode(enc, sym, ctx)

    def _bits(self, planes: np.ndarray, models: list[_Model]) -> float:
        return sum(model.bits(sym, ctx) for model, sym, ctx in self._pieces(planes, models))

    def estimate_bits(self, planes: np.ndarray, family: str) -> float:
        """What `encode(..., mode=None)` would spend on `planes`, in bits, without coding them
        or changing the archive's models: the code length of both modes under the same adaptive
        models and steps, the smaller, each symbol priced at the coder's quantized floor
        (`_Model.bits`): never more than the coded bits but for the flush (at most 64 bits), and
        2e-5 under them on a 2.36M-value float32 tensor, which it prices 5x faster than coding:
        a record that cannot win needs no range coder."""
        itemsize = planes.shape[0]
        shared = self.models.get((family, itemsize)) or _fresh(itemsize)
        return min(
            self._bits(planes, [m.copy() for m in shared]),
            self._bits(planes, _fresh(itemsize)),
        )

    def encode(
        self, enc: RangeEncoder, planes: np.ndarray, family: str, mode: int | None = None
    ) -> int:
        """Code one tensor's planes; return its mode: SHARED (the archive's models, which it
        then updates) or OWN (fresh models for this tensor alone), whichever codes it in fewer
        bits (both are tried: a big tensor unlike the others, a BatchNorm running_var say, is
        cheaper on its own), or `mode` when given."""
        shared = self._models(family, planes.shape[0])
        if mode is None:
            mode = self._trials(planes, family)[0]
        self._code(enc, planes, shared if mode == SHARED else _fresh(planes.shape[0]))
        return mode

    def _trials(self, planes: np.ndarray, family: str) -> tuple[int, RangeEncoder, list[_Model]]:
        """Both modes coded on fresh coders: the smaller's mode (SHARED on a tie), its coder
        and its models after coding."""
        shared = self._models(family, planes.shape[0])
        best = None
        for m in (SHARED, OWN):
            scratch = RangeEncoder()
            models = [x.copy() for x in shared] if m == SHARED else _fresh(planes.shape[0])
            self._code(scratch, planes, models)
            if best is None or scratch.num_bits() < best[1].num_bits():
                best = (m, scratch, models)
        assert best is not None
        return best

    def encode_first(self, planes: np.ndarray, family: str) -> tuple[int, RangeEncoder]:
        """`encode(enc, planes, family)` for a coder that holds nothing yet: the winning trial's
        coder is that coder, so it is returned, not coded a third time (pricing a record on a
        fresh fork, or a pricing context that keeps only models)."""
        mode, coder, models = self._trials(planes, family)
        if mode == SHARED:
            self.models[(family, planes.shape[0])] = models
        return mode, coder

    def decode(
        self, dec: RangeDecoder, itemsize: int, n: int, family: str, mode: int
    ) -> np.ndarray:
        models = self._models(family, itemsize) if mode == SHARED else _fresh(itemsize)
        planes = np.zeros((itemsize, n), np.uint8)
        for j, model in enumerate(models):
            above = planes[0].astype(np.int64) if j == 1 else None
            for a, b in self._steps(model, n):
                planes[j, a:b] = model.decode(dec, b - a, None if above is None else above[a:b])
        return planes


def _fresh(itemsize: int) -> list[_Model]:
    return [_Model(256, 256 if j == 1 else 1) for j in range(itemsize)]
