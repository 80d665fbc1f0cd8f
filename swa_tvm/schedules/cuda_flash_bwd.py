"""The fused CUDA kernels of the gradients (``local_dq``, ``local_dkv``, ``local_dx``,
``global_bwd``): one thread block per work item, the item's band streamed through shared memory in chunks,
every probability recomputed from the saved lse (p = exp(scale * q.k - lse)), so no
score, probability or band copy reaches global memory. FlashAttention-2's backward,
split as the TE's is (``compute_backward``): no kernel scatters, so no atomics.

``local_dq`` (query-major, the forward's items): per item, its query rows and output
gradients go to shared memory with their lse and delta; for each chunk of band keys
(then of extra keys): K and V rows to shared memory; per thread a register tile of
S = Q K^T and of dP = dO V^T; dS = P * (dP - delta) to shared memory; dq += dS K.

``local_dkv`` (key-major: the items of the transposed band, whose partners are the
queries that see a block of keys): per item, its keys and values; for each chunk of
band queries: Q and dO rows with their lse and delta; per thread S^T = K Q^T and dP^T =
V dO^T; P^T and dS^T to shared memory; dv += P^T dO, dk += dS^T Q.

``local_dx`` (the extra keys' own gradients): a block of extra keys streams every row
in chunks, each (row, extra key) pair masked as the forward's extras are
(``extra_visible``).

``global_bwd`` runs the same two steps for the global rows: a block of global rows
streams every key chunk up to its last row's position (d q_global), and a block of keys
streams the global rows in chunks (d k_global, d v_global), each key masked past a
causal row's position.

The NaN rule (``cuda_flash.second_pass``): dS is 0 wherever P is (dk/dv: a select a
score); dq, whose dS K would meet a non-finite K with a weight of 0, is computed again,
every product exact, for an item whose dq came out non-finite.

Products run on CUDA cores in fp32, as in ``cuda_flash``; the masks are the TE's
(``row_key_range``, ``item_key_span``, ``item_inner_span``, ``extra_visible``), the
transposed band being the window with its sides swapped. Each phase is its own loop
over the thread index (see ``cuda_flash``), so the tests run these kernels serially on
the CPU. Arguments and outputs are the TE kernels': dq in the input dtype; dk and dv
per query head in the accumulation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from swa_tvm.compute.forward import extra_visible, row_key_range
from swa_tvm.schedules.cuda_flash import (
    ITEM_SCALARS,
    SHARED_BUDGET,
    _pad,
    band_positions,
    block_last_key,
    chunk_inside,
    clamp_row,
    extra_positions_loader,
    global_fields,
    global_row_last_key,
    item_scalars,
    largest_fitting,
    nonfinite_vote,
    second_pass,
    thread_cols,
)
from swa_tvm.spec import KernelSpec, accum_dtype

KINDS = ("local_dq", "local_dkv", "local_dx", "global_bwd")


@dataclass(frozen=True)
class BwdConfig:
    block: int = 32  # rows of an item: query rows (dq) or keys (dk/dv)
    chunk: int = 32  # band partners per step
    threads: int = 128

    def thread_cols(self, head_dim: int) -> int:
        return thread_cols(head_dim, self.chunk, self.threads)

    def check(self, head_dim: int) -> None:
        cols = self.thread_cols(head_dim)
        if self.block > self.threads:
            raise ValueError(f"backward config: block={self.block} exceeds threads={self.threads} (a thread per row)")
        if self.block % (self.threads // cols):
            raise ValueError(f"backward config: block={self.block} is not a multiple of {self.threads // cols} ({self})")

    def shared_bytes(self, head_dim: int, dtype: str) -> int:
        el = tvm.runtime.DataType(dtype).bits // 8
        tiles = 2 * (self.block + self.chunk) * (head_dim + _pad(dtype)) * el  # item's pair, chunk's pair
        scores = 2 * self.block * (self.chunk + 1) * 4  # dS (and P)
        rows = (self.block + self.chunk) * 2 * 4 + self.block * 2 * 8 + self.chunk * 3 * 8
        return tiles + scores + rows + 16 * 64  # 64-byte alignment each


def default_config(spec: KernelSpec) -> BwdConfig | None:
    """The largest tiles within SHARED_BUDGET (None: none fits, or not a CUDA dtype)."""
    return largest_fitting(BwdConfig, spec) if spec.kind in KINDS else None



def stat_rows(threads: int, count: int):
    """A T.macro ``each(pos_of, n, store)``: for each row i < ``count``, one of
    ``threads`` threads calls ``store(i, j, ok)``, j its position pos_of(i) clamped to
    [0, n) and ok whether pos_of(i) lies in [0, n)."""
    steps = -(-count // threads)

    @T.macro
    def each(pos_of, n, store):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for x in T.serial(steps):
                i = T.meta_var(x * threads + tx)
                if i < count:
                    ok = T.meta_var(T.And(pos_of(i) >= 0, pos_of(i) < T.Cast(str(pos_of(i).ty), n)))
                    store(i, clamp_row(pos_of(i), n), ok)

    return each


def stats_loader(threads: int, count: int, acc: str, lse_scale=None):
    """A T.macro ``load(lse_t, delta_t, lse, delta, b, h, pos_of, n)``: lse (times
    ``lse_scale``, if given) and delta of rows i < ``count`` from positions pos_of(i)
    into shared tables; a position outside [0, n) gets lse = +inf and delta = 0, so all
    its probabilities are 0."""
    each = stat_rows(threads, count)
    INF, ZERO = tirx.const(float("inf"), acc), tirx.const(0.0, acc)
    factor = tirx.const(1.0, acc) if lse_scale is None else lse_scale

    @T.macro
    def store(lse_t, delta_t, lse, delta, b, h, i, j, ok):
        lse_t[i] = T.Select(ok, lse[b, h, j] * factor, INF)
        delta_t[i] = T.Select(ok, delta[b, h, j], ZERO)

    @T.macro
    def load(lse_t, delta_t, lse, delta, b, h, pos_of, n):
        each(pos_of, n, lambda i, j, ok: store(lse_t, delta_t, lse, delta, b, h, i, j, ok))

    return load

def last_keys_loader(threads: int, count: int, causal: bool):
    """A T.macro ``load(last_t, gidx, b, g0, G, Tn)``: the last key each of the global
    rows g0 .. g0 + count - 1 sees (``global_row_last_key``; -1 past G) into a shared
    table, for the kernels where a block of keys streams the global rows."""
    steps = -(-count // threads)

    @T.macro
    def load(last_t, gidx, b, g0, G, Tn):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for x in T.serial(steps):
                i = T.meta_var(x * threads + tx)
                if i < count:
                    last_t[i] = global_row_last_key(gidx, b, g0 + i, G, Tn, causal)

    return load


def flash_bwd(spec: KernelSpec, config: BwdConfig | None = None) -> tvm.tirx.PrimFunc:
    """The fused CUDA PrimFunc of a gradient spec (``KINDS``), with the TE kernel's
    arguments and name."""
    if spec.kind not in KINDS:
        raise ValueError(f"kernel {spec.name}: the fused backward serves {KINDS}, not {spec.kind!r}")
    cfg = config or default_config(spec)
    if cfg is None:
        raise ValueError(
            f"kernel {spec.name}: no backward tile of {spec.dtype} x head_dim {spec.head_dim} fits "
            f"{SHARED_BUDGET // 1024} KiB of shared memory"
        )
    cfg.check(spec.head_dim)
    return _build(spec, cfg).with_attr("global_symbol", spec.name)


def _build(spec: KernelSpec, cfg: BwdConfig):  # noqa: C901 - four kernels, phase by phase
    D, dt, acc = spec.head_dim, spec.dtype, accum_dtype(spec.dtype)
    lo, hi, maxd, extras = spec.left, spec.right, spec.max_dilation, spec.extras
    BR, KC, NT = cfg.block, cfg.chunk, cfg.threads
    TX = cfg.thread_cols(D)
    TY = NT // TX
    RS, CS, CA = BR // TY, KC // TX, D // TX  # register tiles: rows x partners, rows x columns
    DP, SP = D + _pad(dt), KC + 1  # padded rows of the tiles
    R_STEPS, C_STEPS = -(-BR * D // NT), -(-KC * D // NT)  # tile copies
    load_extra_positions = extra_positions_loader(NT, KC)
    store_item, load_item = item_scalars(NT, BR, lo, hi, KC)
    store_key_item, load_key_item = item_scalars(NT, BR, hi, lo, KC)  # the transposed band (dk/dv)
    SH = "shared"
    ZERO, ONE = tirx.const(0.0, acc), tirx.const(1.0, acc)

    def f32(x):
        return x if dt == acc else T.Cast(acc, x)

    @T.macro
    def load_pair(A, Bt, src_a, src_b, b, hh, pos_of, Tn, rows, steps):
        # Rows i < ``rows`` of two tiles from sequence positions pos_of(i), clamped (a row
        # out of range is masked by the scores).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.serial(steps):
                e = T.meta_var(x * NT + tx)
                if e < rows * D:
                    i = T.meta_var(e // D)
                    col = T.meta_var(e % D)
                    j = T.meta_var(clamp_row(pos_of(i), Tn))
                    A[i * DP + col] = src_a[b, hh, j, col]
                    Bt[i * DP + col] = src_b[b, hh, j, col]

    load_row_stats, load_chunk_stats = stats_loader(NT, BR, acc), stats_loader(NT, KC, acc)

    @T.macro
    def products(A, A2, Bt, B2, sacc, pacc):
        # Per thread, an RS x CS tile of A Bt^T and of A2 B2^T (rows of the item against
        # partners of the chunk), over the head dim.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CS):
                    sacc[tx, ii * CS + jj] = ZERO
                    pacc[tx, ii * CS + jj] = ZERO
            for cc in T.serial(D):
                for ii in T.unroll(RS):
                    for jj in T.unroll(CS):
                        row = T.meta_var((tx // TX) * RS + ii)
                        col = T.meta_var(tx % TX + TX * jj)
                        sacc[tx, ii * CS + jj] = sacc[tx, ii * CS + jj] + f32(A[row * DP + cc]) * f32(Bt[col * DP + cc])
                        pacc[tx, ii * CS + jj] = pacc[tx, ii * CS + jj] + f32(A2[row * DP + cc]) * f32(B2[col * DP + cc])

    @T.macro
    def accumulate(W_s, Ct, racc, exact=False):
        # racc += W C: the RS rows of W_s [rows, partners] (shared) against the chunk's
        # tile C [partners, D], CA columns per thread. With ``exact`` (dq's second pass,
        # ``cuda_flash.second_pass``), a value of C reaches a row only where its W is not
        # 0: a masked key's dS is exactly 0, but 0 * NaN is NaN.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if not exact:
                for kk in T.serial(KC):
                    for ii in T.unroll(RS):
                        for jj in T.unroll(CA):
                            racc[tx, ii * CA + jj] = racc[tx, ii * CA + jj] + W_s[((tx // TX) * RS + ii) * SP + kk] * f32(
                                Ct[kk * DP + tx % TX + TX * jj]
                            )
            else:
                for kk in T.serial(KC):
                    for ii in T.unroll(RS):
                        for jj in T.unroll(CA):
                            racc[tx, ii * CA + jj] = racc[tx, ii * CA + jj] + W_s[((tx // TX) * RS + ii) * SP + kk] * T.Select(
                                W_s[((tx // TX) * RS + ii) * SP + kk] == ZERO, ZERO, f32(Ct[kk * DP + tx % TX + TX * jj])
                            )

    @T.macro
    def zero(racc):
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.unroll(RS * CA):
                racc[tx, x] = ZERO

    @T.macro
    def write_rows(dst, racc, b, h, pos_of, n, scale):
        # dst[b, h, pos_of(row)] = racc * scale for the rows with pos_of(row) < n, in
        # dst's dtype (the input dtype for dq, the accumulation dtype for dk and dv).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CA):
                    if pos_of((tx // TX) * RS + ii) < n:
                        dst[b, h, pos_of((tx // TX) * RS + ii), tx % TX + TX * jj] = T.Cast(
                            dst.dtype, racc[tx, ii * CA + jj] * scale
                        )

    any_nonfinite = nonfinite_vote(NT, RS * CA)

    @T.macro
    def dq_chunk(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, visible, scale, exact):
        products(Qs, dOs, Kt, Vt, sacc, pacc)
        # dS = P (dP - delta), P = exp(S - lse); masked entries 0 (a row with lse = +inf,
        # a global row or one past the end, gets exp(-inf) = 0). With ``exact`` (the
        # second pass), dS = 0 wherever P is 0, not 0 * (dP - delta): NaN where a v or
        # the row's delta is.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CS):
                    row = T.meta_var((tx // TX) * RS + ii)
                    col = T.meta_var(tx % TX + TX * jj)
                    if exact:
                        sacc[tx, ii * CS + jj] = T.Select(
                            visible(row, col), T.exp(sacc[tx, ii * CS + jj] * scale - lse_s[row]), ZERO
                        )
                        S_s[row * SP + col] = T.Select(
                            sacc[tx, ii * CS + jj] == ZERO, ZERO,
                            sacc[tx, ii * CS + jj] * (pacc[tx, ii * CS + jj] - delta_s[row]),
                        )
                    else:
                        S_s[row * SP + col] = T.Select(
                            visible(row, col),
                            T.exp(sacc[tx, ii * CS + jj] * scale - lse_s[row]) * (pacc[tx, ii * CS + jj] - delta_s[row]),
                            ZERO,
                        )
        accumulate(S_s, Kt, dacc, exact)

    @T.macro
    def dkv_chunk(Ks, Vs, Qt, dOt, P_s, S_s, sacc, pacc, lse_c, delta_c, kacc, vacc, visible, scale):
        # Keys of the item (rows) against a chunk of the queries that see them (columns):
        # P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta) to shared memory; dv += P^T dO,
        # dk += dS^T Q.
        products(Ks, Vs, Qt, dOt, sacc, pacc)
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CS):
                    row = T.meta_var((tx // TX) * RS + ii)
                    col = T.meta_var(tx % TX + TX * jj)
                    P_s[row * SP + col] = T.Select(visible(row, col), T.exp(sacc[tx, ii * CS + jj] * scale - lse_c[col]), ZERO)
                    # Where P is 0 (masked, or a query whose lse is +inf: eager's global
                    # rows, a +inf sink's), dS 0, not 0 * (dP - delta), NaN where the
                    # item's v or the query's delta (a row that sees NaN) is: a select a score.
                    S_s[row * SP + col] = T.Select(
                        P_s[row * SP + col] == ZERO, ZERO, P_s[row * SP + col] * (pacc[tx, ii * CS + jj] - delta_c[col])
                    )
        accumulate(P_s, dOt, vacc)
        accumulate(S_s, Qt, kacc)

    @T.macro
    def dq_chunks(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, first_s, last_s, xpos_s, xres_s, xt_s, k, v,
                  xidx, scale, b, kvh, d, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi, Tn, E, exact):
        # dq's band chunks that meet the item's span, then its extra keys: every dS K exact
        # with ``exact``, else as fast as they go (``cuda_flash.second_pass``).
        for c in T.serial(c_begin, c_end):
            load_pair(Kt, Vt, k, v, b, kvh, band_positions(key0, d, c, KC), Tn, KC, C_STEPS)
            dq_chunk(
                Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc,
                lambda row, col: T.Or(
                    chunk_inside(c, KC, inner_lo, inner_hi),
                    T.And(c * KC + col >= first_s[row], c * KC + col <= last_s[row]),
                ),
                scale,
                exact,
            )
        if extras:
            for xc in T.serial((E + (KC - 1)) // KC):
                load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                load_pair(Kt, Vt, k, v, b, kvh, lambda kk: xpos_s[kk], Tn, KC, C_STEPS)
                dq_chunk(
                    Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc,
                    lambda row, col: extra_visible(
                        lo, hi, Tn, xpos_s[col], xres_s[col], xt_s[col], row0 + d * row, m0 + row, r
                    ),
                    scale, exact,
                )

    @T.macro
    def dq_body(q, k, v, dil, xidx, dout, lse, delta, scale, dq, B, H, Hkv, Tn, E):
        nitems = T.meta_var((Tn + (BR - 1)) // BR + (maxd - 1))
        for item in T.thread_binding(B * H * nitems, thread="blockIdx.x"):
            with T.sblock("flash_dq"):
                T.reads()
                T.writes()
                Qs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                dOs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Kt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                Vt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                S_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                lse_s = T.alloc_buffer((BR,), acc, scope=SH)
                delta_s = T.alloc_buffer((BR,), acc, scope=SH)
                first_s = T.alloc_buffer((BR,), "int64", scope=SH)
                last_s = T.alloc_buffer((BR,), "int64", scope=SH)
                xpos_s = T.alloc_buffer((KC,), "int64", scope=SH)
                xres_s = T.alloc_buffer((KC,), "int64", scope=SH)
                xt_s = T.alloc_buffer((KC,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                pacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                dacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                fld = T.alloc_buffer((ITEM_SCALARS,), "int64", scope="local")
                nf_s = T.alloc_buffer((1,), "int32", scope=SH)  # the NaN rule's vote (``any_nonfinite``)
                nf = T.alloc_buffer((1,), "int32", scope="local")

                store_item(fld, item, H, Hkv, nitems, dil, Tn)
                b, h, beta, d, kvh, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi = T.meta_var(load_item(fld))
                # 1. Rows: lse and delta (a row past the end: +inf and 0), band intervals,
                # queries and output gradients.
                load_row_stats(lse_s, delta_s, lse, delta, b, h, lambda i: row0 + d * i, Tn)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if tx < BR:
                        first_s[tx] = row_key_range(lo, hi, Tn, d, m0, r, tx)[0]
                        last_s[tx] = row_key_range(lo, hi, Tn, d, m0, r, tx)[1]
                    if tx == 0:
                        nf_s[0] = 0
                load_pair(Qs, dOs, q, dout, b, h, lambda i: row0 + d * i, Tn, BR, R_STEPS)
                zero(dacc)
                # 2. The band, chunk by chunk, over the chunks that meet the item's span,
                # then the extra keys; again, exact, where dq came out non-finite.
                dq_chunks(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, first_s, last_s, xpos_s, xres_s, xt_s,
                          k, v, xidx, scale, b, kvh, d, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi, Tn, E, False)
                any_nonfinite(dacc, nf_s, nf)
                for once in T.serial(second_pass(nf)):
                    zero(dacc)
                    dq_chunks(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, first_s, last_s, xpos_s, xres_s,
                              xt_s, k, v, xidx, scale, b, kvh, d, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi,
                              Tn, E, True)
                # 3. dq = scale * dS K to the item's rows.
                write_rows(dq, dacc, b, h, lambda i: row0 + d * i, Tn, scale)

    # The transposed band: key j is seen by the queries j + u*d, -right <= u <= left.
    tlo, thi = hi, lo

    @T.macro
    def dkv_body(q, k, v, dil, dout, lse, delta, scale, dk, dv, B, H, Hkv, Tn):
        nitems = T.meta_var((Tn + (BR - 1)) // BR + (maxd - 1))
        for item in T.thread_binding(B * H * nitems, thread="blockIdx.x"):
            with T.sblock("flash_dkv"):
                T.reads()
                T.writes()
                Ks = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Vs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Qt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                dOt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                P_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                S_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                lse_c = T.alloc_buffer((KC,), acc, scope=SH)
                delta_c = T.alloc_buffer((KC,), acc, scope=SH)
                first_s = T.alloc_buffer((BR,), "int64", scope=SH)
                last_s = T.alloc_buffer((BR,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                pacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                kacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                vacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                fld = T.alloc_buffer((ITEM_SCALARS,), "int64", scope="local")

                # row0: the item's first key; key0: the position of band (query) index 0.
                store_key_item(fld, item, H, Hkv, nitems, dil, Tn)
                b, h, beta, d, kvh, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi = T.meta_var(load_key_item(fld))
                # 1. Keys: the query interval that sees each, keys and values.
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if tx < BR:
                        first_s[tx] = row_key_range(tlo, thi, Tn, d, m0, r, tx)[0]
                        last_s[tx] = row_key_range(tlo, thi, Tn, d, m0, r, tx)[1]
                load_pair(Ks, Vs, k, v, b, kvh, lambda i: row0 + d * i, Tn, BR, R_STEPS)
                zero(kacc)
                zero(vacc)
                # 2. The queries that see the item, chunk by chunk.
                for c in T.serial(c_begin, c_end):
                    load_pair(Qt, dOt, q, dout, b, h, band_positions(key0, d, c, KC), Tn, KC, C_STEPS)
                    load_chunk_stats(lse_c, delta_c, lse, delta, b, h, band_positions(key0, d, c, KC), Tn)
                    dkv_chunk(
                        Ks, Vs, Qt, dOt, P_s, S_s, sacc, pacc, lse_c, delta_c, kacc, vacc,
                        lambda row, col: T.Or(
                            chunk_inside(c, KC, inner_lo, inner_hi),
                            T.And(c * KC + col >= first_s[row], c * KC + col <= last_s[row]),
                        ),
                        scale,
                    )
                # 3. dk = scale * dS^T Q and dv = P^T dO to the item's keys (per query head).
                write_rows(dk, kacc, b, h, lambda i: row0 + d * i, Tn, scale)
                write_rows(dv, vacc, b, h, lambda i: row0 + d * i, Tn, ONE)

    causal = spec.causal
    load_last_keys = last_keys_loader(NT, KC, causal)

    @T.macro
    def global_dq_chunks(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, last_s, k, v, gidx, scale, b, kvh, g0, G,
                         Tn, exact):
        # Every key chunk up to the block's last visible key (``dq_chunks``' ``exact``).
        for c in T.serial(T.floordiv(block_last_key(gidx, b, g0, G, Tn, BR, causal), KC) + 1):
            load_pair(Kt, Vt, k, v, b, kvh, lambda kk: c * KC + kk, Tn, KC, C_STEPS)
            dq_chunk(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, lambda row, col: c * KC + col <= last_s[row],
                     scale, exact)

    @T.macro
    def global_dq_body(qg, k, v, gidx, dout, lse, delta, scale, dqg, B, H, Hkv, Tn, G):
        nblk = T.meta_var((G + (BR - 1)) // BR)
        for item in T.thread_binding(B * H * nblk, thread="blockIdx.x"):
            with T.sblock("flash_global_dq"):
                T.reads()
                T.writes()
                Qs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                dOs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Kt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                Vt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                S_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                lse_s = T.alloc_buffer((BR,), acc, scope=SH)
                delta_s = T.alloc_buffer((BR,), acc, scope=SH)
                last_s = T.alloc_buffer((BR,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                pacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                dacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                nf_s = T.alloc_buffer((1,), "int32", scope=SH)  # the NaN rule's vote (``any_nonfinite``)
                nf = T.alloc_buffer((1,), "int32", scope="local")

                b, h, g0, kvh = T.meta_var(global_fields(item, H, Hkv, nblk, BR))
                # 1. Global rows: lse, delta and last visible key (padding rows past G: +inf,
                # 0 and -1), their queries and output gradients.
                load_row_stats(lse_s, delta_s, lse, delta, b, h, lambda i: g0 + i, G)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if tx < BR:
                        last_s[tx] = global_row_last_key(gidx, b, g0 + tx, G, Tn, causal)
                    if tx == 0:
                        nf_s[0] = 0
                load_pair(Qs, dOs, qg, dout, b, h, lambda i: g0 + i, G, BR, R_STEPS)
                zero(dacc)
                # 2. Every key chunk up to the block's last visible key; again, exact, where
                # dq came out non-finite.
                global_dq_chunks(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, last_s, k, v, gidx, scale, b, kvh,
                                 g0, G, Tn, False)
                any_nonfinite(dacc, nf_s, nf)
                for once in T.serial(second_pass(nf)):
                    zero(dacc)
                    global_dq_chunks(Qs, dOs, Kt, Vt, S_s, sacc, pacc, lse_s, delta_s, dacc, last_s, k, v, gidx, scale, b,
                                     kvh, g0, G, Tn, True)
                # 3. d q_global = scale * dS K.
                write_rows(dqg, dacc, b, h, lambda i: g0 + i, G, scale)

    @T.macro
    def global_dkv_body(qg, k, v, gidx, dout, lse, delta, scale, dkg, dvg, B, H, Hkv, Tn, G):
        nblk = T.meta_var((Tn + (BR - 1)) // BR)
        for item in T.thread_binding(B * H * nblk, thread="blockIdx.x"):
            with T.sblock("flash_global_dkv"):
                T.reads()
                T.writes()
                Ks = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Vs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Qt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                dOt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                P_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                S_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                lse_c = T.alloc_buffer((KC,), acc, scope=SH)
                delta_c = T.alloc_buffer((KC,), acc, scope=SH)
                gpos_c = T.alloc_buffer((KC,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                pacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                kacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                vacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")

                # A block of BR keys from j0 against every global row, KC rows a chunk.
                b, h, j0, kvh = T.meta_var(global_fields(item, H, Hkv, nblk, BR))
                load_pair(Ks, Vs, k, v, b, kvh, lambda i: j0 + i, Tn, BR, R_STEPS)
                zero(kacc)
                zero(vacc)
                for c in T.serial((G + (KC - 1)) // KC):
                    load_pair(Qt, dOt, qg, dout, b, h, lambda kk: c * KC + kk, G, KC, C_STEPS)
                    load_chunk_stats(lse_c, delta_c, lse, delta, b, h, lambda kk: c * KC + kk, G)
                    load_last_keys(gpos_c, gidx, b, c * KC, G, Tn)
                    dkv_chunk(
                        Ks, Vs, Qt, dOt, P_s, S_s, sacc, pacc, lse_c, delta_c, kacc, vacc,
                        lambda row, col: j0 + row <= gpos_c[col], scale,
                    )
                write_rows(dkg, kacc, b, h, lambda i: j0 + i, Tn, scale)
                write_rows(dvg, vacc, b, h, lambda i: j0 + i, Tn, ONE)

    load_key_positions = extra_positions_loader(NT, BR)

    @T.macro
    def dx_body(q, k, v, dil, xidx, dout, lse, delta, scale, dkx, dvx, B, H, Hkv, Tn, E):
        nblk = T.meta_var((E + (BR - 1)) // BR)
        for item in T.thread_binding(B * H * nblk, thread="blockIdx.x"):
            with T.sblock("flash_dx"):
                T.reads()
                T.writes()
                Ks = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Vs = T.alloc_buffer((BR * DP,), dt, scope=SH)
                Qt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                dOt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                P_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                S_s = T.alloc_buffer((BR * SP,), acc, scope=SH)
                lse_c = T.alloc_buffer((KC,), acc, scope=SH)
                delta_c = T.alloc_buffer((KC,), acc, scope=SH)
                xpos_s = T.alloc_buffer((BR,), "int64", scope=SH)
                xres_s = T.alloc_buffer((BR,), "int64", scope=SH)
                xt_s = T.alloc_buffer((BR,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                pacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                kacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                vacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")

                # A block of BR extra keys (extra_idx[b, e0:e0+BR]) against every row.
                b, h, e0, kvh = T.meta_var(global_fields(item, H, Hkv, nblk, BR))
                d = T.meta_var(T.Cast("int64", dil[h]))
                load_key_positions(xpos_s, xres_s, xt_s, xidx, b, T.truncdiv(e0, BR), d, E)
                load_pair(Ks, Vs, k, v, b, kvh, lambda i: xpos_s[i], Tn, BR, R_STEPS)
                zero(kacc)
                zero(vacc)
                for c in T.serial((Tn + (KC - 1)) // KC):
                    load_pair(Qt, dOt, q, dout, b, h, lambda kk: c * KC + kk, Tn, KC, C_STEPS)
                    load_chunk_stats(lse_c, delta_c, lse, delta, b, h, lambda kk: c * KC + kk, Tn)
                    dkv_chunk(
                        Ks, Vs, Qt, dOt, P_s, S_s, sacc, pacc, lse_c, delta_c, kacc, vacc,
                        # Row i = c*KC + col sees extra key `row` as an extra (not inside
                        # its window, not in a causal row's future, not padding, i < T).
                        lambda row, col: extra_visible(
                            lo, hi, Tn, xpos_s[row], xres_s[row], xt_s[row], c * KC + col,
                            T.floordiv(c * KC + col, d), T.floormod(c * KC + col, d),
                        ),
                        scale,
                    )
                write_rows(dkx, kacc, b, h, lambda i: e0 + i, E, scale)
                write_rows(dvx, vacc, b, h, lambda i: e0 + i, E, ONE)

    if spec.kind == "local_dx":
        return _dx_kernel(dx_body, D, dt, acc)
    if spec.kind == "global_bwd":
        return _global_kernel(global_dq_body, global_dkv_body, D, dt, acc)
    if spec.kind == "local_dkv":
        return _dkv_kernel(dkv_body, D, dt, acc, extras)
    return _dq_kernel(dq_body, D, dt, acc, extras)


def _dx_kernel(body, D: int, dt: str, acc: str):
    """The PrimFunc with local_dx's arguments: q, k, v, dilation, extra_idx, dout, lse,
    delta, scale, dk_extra, dv_extra."""

    @T.prim_func(s_tir=True)
    def kernel_dx(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, x_h: T.handle, do_h: T.handle,
                  lse_h: T.handle, delta_h: T.handle, scale: T.float32, dk_h: T.handle, dv_h: T.handle):
        B, H, Hkv, Tn, E = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (B, H, Tn, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        dil = T.match_buffer(dil_h, (H,), "int32")
        xidx = T.match_buffer(x_h, (B, E), "int32")
        dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
        lse = T.match_buffer(lse_h, (B, H, Tn), acc)
        delta = T.match_buffer(delta_h, (B, H, Tn), acc)
        dkx = T.match_buffer(dk_h, (B, H, E, D), acc)
        dvx = T.match_buffer(dv_h, (B, H, E, D), acc)
        body(q, k, v, dil, xidx, dout, lse, delta, scale, dkx, dvx, B, H, Hkv, Tn, E)

    return kernel_dx


def _global_kernel(dq_body, dkv_body, D: int, dt: str, acc: str):
    """The PrimFunc with global_bwd's arguments: q_global, k_global, v_global,
    global_idx, dout, lse, delta (of the global rows), scale, dq_global, dk_global,
    dv_global; two kernels, one per output side."""

    @T.prim_func(s_tir=True)
    def kernel_g(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, do_h: T.handle, lse_h: T.handle,
                 delta_h: T.handle, scale: T.float32, dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        B, H, Hkv, Tn, G = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qg = T.match_buffer(q_h, (B, H, G, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        gidx = T.match_buffer(g_h, (B, G), "int32")
        dout = T.match_buffer(do_h, (B, H, G, D), dt)
        lse = T.match_buffer(lse_h, (B, H, G), acc)
        delta = T.match_buffer(delta_h, (B, H, G), acc)
        dqg = T.match_buffer(dq_h, (B, H, G, D), dt)
        dkg = T.match_buffer(dk_h, (B, H, Tn, D), acc)
        dvg = T.match_buffer(dv_h, (B, H, Tn, D), acc)
        dq_body(qg, k, v, gidx, dout, lse, delta, scale, dqg, B, H, Hkv, Tn, G)
        dkv_body(qg, k, v, gidx, dout, lse, delta, scale, dkg, dvg, B, H, Hkv, Tn, G)

    return kernel_g


def _global_split_kernel(dq_body, dkv_body, D: int, dt: str, acc: str):
    """``_global_kernel``'s PrimFunc with the argument of ``library.GLOBAL_BWD_WORKSPACE``
    after dv_global (the dq pieces' workspace); ``dq_body`` gets it and S after the shape
    vars."""

    @T.prim_func(s_tir=True)
    def kernel_gs(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, do_h: T.handle, lse_h: T.handle,
                  delta_h: T.handle, scale: T.float32, dq_h: T.handle, dk_h: T.handle, dv_h: T.handle,
                  ws_h: T.handle):
        B, H, Hkv, Tn, G, S = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qg = T.match_buffer(q_h, (B, H, G, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        gidx = T.match_buffer(g_h, (B, G), "int32")
        dout = T.match_buffer(do_h, (B, H, G, D), dt)
        lse = T.match_buffer(lse_h, (B, H, G), acc)
        delta = T.match_buffer(delta_h, (B, H, G), acc)
        dqg = T.match_buffer(dq_h, (B, H, G, D), dt)
        dkg = T.match_buffer(dk_h, (B, H, Tn, D), acc)
        dvg = T.match_buffer(dv_h, (B, H, Tn, D), acc)
        ws_dq = T.match_buffer(ws_h, (B, H, S, G, D), "float32")
        dq_body(qg, k, v, gidx, dout, lse, delta, scale, dqg, ws_dq, B, H, Hkv, Tn, G, S)
        dkv_body(qg, k, v, gidx, dout, lse, delta, scale, dkg, dvg, B, H, Hkv, Tn, G)

    return kernel_gs


def _dq_kernel(body, D: int, dt: str, acc: str, extras: bool):
    """The PrimFunc with local_dq's arguments: q, k, v, dilation, [extra_idx], dout, lse,
    delta, scale, dq."""
    if extras:

        @T.prim_func(s_tir=True)
        def kernel_x(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, x_h: T.handle, do_h: T.handle,
                     lse_h: T.handle, delta_h: T.handle, scale: T.float32, dq_h: T.handle):
            B, H, Hkv, Tn, E = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (B, H, Tn, D), dt)
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
            dil = T.match_buffer(dil_h, (H,), "int32")
            xidx = T.match_buffer(x_h, (B, E), "int32")
            dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
            lse = T.match_buffer(lse_h, (B, H, Tn), acc)
            delta = T.match_buffer(delta_h, (B, H, Tn), acc)
            dq = T.match_buffer(dq_h, (B, H, Tn, D), dt)
            body(q, k, v, dil, xidx, dout, lse, delta, scale, dq, B, H, Hkv, Tn, E)

        return kernel_x

    @T.prim_func(s_tir=True)
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, do_h: T.handle, lse_h: T.handle,
               delta_h: T.handle, scale: T.float32, dq_h: T.handle):
        B, H, Hkv, Tn = T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (B, H, Tn, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        dil = T.match_buffer(dil_h, (H,), "int32")
        dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
        lse = T.match_buffer(lse_h, (B, H, Tn), acc)
        delta = T.match_buffer(delta_h, (B, H, Tn), acc)
        dq = T.match_buffer(dq_h, (B, H, Tn, D), dt)
        body(q, k, v, dil, None, dout, lse, delta, scale, dq, B, H, Hkv, Tn, T.int64(0))

    return kernel


def _dkv_kernel(body, D: int, dt: str, acc: str, extras: bool):
    """The PrimFunc with local_dkv's arguments: q, k, v, dilation, [extra_idx] (unread:
    the extras' key gradients are local_dx's), dout, lse, delta, scale, dk, dv."""
    if extras:

        @T.prim_func(s_tir=True)
        def kernel_x(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, x_h: T.handle, do_h: T.handle,
                     lse_h: T.handle, delta_h: T.handle, scale: T.float32, dk_h: T.handle, dv_h: T.handle):
            B, H, Hkv, Tn, E = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (B, H, Tn, D), dt)
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
            dil = T.match_buffer(dil_h, (H,), "int32")
            T.match_buffer(x_h, (B, E), "int32")
            dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
            lse = T.match_buffer(lse_h, (B, H, Tn), acc)
            delta = T.match_buffer(delta_h, (B, H, Tn), acc)
            dk = T.match_buffer(dk_h, (B, H, Tn, D), acc)
            dv = T.match_buffer(dv_h, (B, H, Tn, D), acc)
            body(q, k, v, dil, dout, lse, delta, scale, dk, dv, B, H, Hkv, Tn)

        return kernel_x

    @T.prim_func(s_tir=True)
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, dil_h: T.handle, do_h: T.handle, lse_h: T.handle,
               delta_h: T.handle, scale: T.float32, dk_h: T.handle, dv_h: T.handle):
        B, H, Hkv, Tn = T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (B, H, Tn, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        dil = T.match_buffer(dil_h, (H,), "int32")
        dout = T.match_buffer(do_h, (B, H, Tn, D), dt)
        lse = T.match_buffer(lse_h, (B, H, Tn), acc)
        delta = T.match_buffer(delta_h, (B, H, Tn), acc)
        dk = T.match_buffer(dk_h, (B, H, Tn, D), acc)
        dv = T.match_buffer(dv_h, (B, H, Tn, D), acc)
        body(q, k, v, dil, dout, lse, delta, scale, dk, dv, B, H, Hkv, Tn)

    return kernel
