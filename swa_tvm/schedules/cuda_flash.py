"""The fused (flash-style) CUDA kernel of the local forward: one thread block per work
item, the item's key band streamed through shared memory in chunks with an online
softmax, so no score, probability or band copy ever reaches global memory.

TE cannot say "carry a running max across a loop", so, like the scans and sorts of TVM's
own ``topi/cuda``, this kernel is written out in TIR. The math still comes from
``swa_tvm.compute``: which band keys a row sees (``row_key_range``), which chunks an item
needs at all (``item_key_span``) and which extra keys a row sees (``extra_visible``) are
the same expressions the TE kernels use, and the item decomposition is the TE's (with
this kernel's own block of rows). Results equal the TE kernel's up to float rounding.

Per item (``block_q`` rows of one residue class of one head), with ``threads`` threads:

1. the item's query rows go to shared memory; each row's running max starts at the
   head's sink logit (a sink adds exp(sink - max) to the denominator and no value) and
   its visible band interval is computed once;
2. for each chunk of ``chunk`` band keys that meets the item's span, then for each chunk
   of extra keys (global positions and sinks, when the spec has them): the keys and
   values are copied to shared memory; scores S = Q K^T (one register tile per thread,
   masked); a thread per row updates the running max m; each thread turns its score
   tile into probabilities P = exp(S - m); a thread per row updates the sum l; every
   accumulator is rescaled by exp(m_old - m) and gains P V (one register tile per
   thread);
3. out = acc / l and lse = m + log l are written to the item's rows; an item whose
   outputs came out non-finite first runs step 2 again, every product exact (the NaN
   rule, ``second_pass``).

Each phase is its own loop over the thread index. On the GPU they all run on the same
threads, TVM inserting the barriers between them; turned into serial loops they run one
after another on the CPU, which is how the tests check this kernel without a GPU.
Products run on CUDA cores in fp32: this kernel serves float32 (and head dims the
tensor-core kernel, ``cuda_flash_tc``, does not take).

The global rows (kind "global") run on the same phases: a block of global rows streams
the key chunks from 0 to its last row's position (causal) or to T, each row masking the
keys past its own position; no dilation, no extra keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from swa_tvm.compute.forward import extra_visible, item_inner_span, item_key_span, row_key_range
from swa_tvm.spec import KernelSpec, accum_dtype

# Static shared memory of one block. More needs TVM's dynamic shared memory, whose
# buffers TVM merges into one, after which its barrier planner can no longer tell the
# tiles apart and refuses the row phases' loops of this kernel and cuda_flash_bwd. The
# tensor-core kernels have no such loops: their larger tiles take dynamic shared memory
# (a barrier more per chunk, the planner seeing one buffer) up to SHARED_LIMIT, the
# per-block opt-in limit of every sm_80+ GPU (sm_86/sm_89 99 KiB; sm_80 163, sm_90 227),
# which TVM's runtime sets at launch. Kernels that run on sm_90a alone (wgmma) may take
# sm_90's (SHARED_LIMIT_SM90).
SHARED_BUDGET = 48 * 1024
SHARED_LIMIT = 99 * 1024
SHARED_LIMIT_SM90 = 227 * 1024


def shared_scope(nbytes: int, limit: int = SHARED_LIMIT) -> str:
    """The scope of a tensor-core kernel's shared tiles: static within SHARED_BUDGET,
    else dynamic (ValueError past ``limit``)."""
    if nbytes > limit:
        raise ValueError(f"{nbytes} bytes of shared memory exceed the {limit // 1024} KiB of a block")
    return "shared" if nbytes <= SHARED_BUDGET else "shared.dyn"


@dataclass(frozen=True)
class FlashConfig:
    block_q: int = 64  # query rows per item (one thread block)
    chunk: int = 64  # band keys per step of the online softmax
    threads: int = 128

    def check(self, head_dim: int) -> None:
        cols = self.thread_cols(head_dim)
        rows = self.threads // cols
        if self.block_q > self.threads:
            raise ValueError(f"flash config: block_q={self.block_q} exceeds threads={self.threads} (a thread per row)")
        for name, value, divisor in (
            ("block_q", self.block_q, rows),
            ("chunk", self.chunk, cols),
        ):
            if value % divisor:
                raise ValueError(f"flash config: {name}={value} is not a multiple of {divisor} ({self})")

    def thread_cols(self, head_dim: int) -> int:
        return thread_cols(head_dim, self.chunk, self.threads)

    def shared_bytes(self, head_dim: int, dtype: str) -> int:
        el = tvm.runtime.DataType(dtype).bits // 8
        pad = _pad(dtype)
        tiles = (self.block_q + self.chunk) * (head_dim + pad) * el + self.chunk * head_dim * el
        rows = self.block_q * (3 * 4 + 2 * 8)  # m, l, factor (fp32); first, last (int64)
        extras = self.chunk * 3 * 8  # extra keys' position, residue, residue index
        return tiles + self.block_q * (self.chunk + 1) * 4 + rows + extras + 12 * 64  # 64-byte alignment each


def _pad(dtype: str) -> int:
    """Row padding (elements) of the Q and K tiles: rows one 4-byte bank apart, so the 16
    threads reading 16 rows of one column hit 16 banks."""
    return 4 // (tvm.runtime.DataType(dtype).bits // 8) if tvm.runtime.DataType(dtype).bits < 32 else 1


def thread_cols(head_dim: int, chunk: int, threads: int) -> int:
    """Threads along a tile's columns: they read consecutive shared-memory words."""
    return next(c for c in (16, 8, 4, 2, 1) if head_dim % c == 0 and chunk % c == 0 and threads % c == 0)


def largest_fitting(make, spec: KernelSpec, sizes=((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))):
    """``make(*size)`` for the first of ``sizes`` (largest first) whose tiles fit
    SHARED_BUDGET; None where none fits (very large head dims) or the dtype is not one
    CUDA serves."""
    if spec.dtype not in ("float32", "float16", "bfloat16"):
        return None
    for size in sizes:
        cfg = make(*size)
        if cfg.shared_bytes(spec.head_dim, spec.dtype) <= SHARED_BUDGET:
            return cfg
    return None


def default_config(spec: KernelSpec) -> FlashConfig | None:
    return largest_fitting(FlashConfig, spec)


def flash(spec: KernelSpec, config: FlashConfig | None = None) -> tvm.tirx.PrimFunc:
    """The fused CUDA PrimFunc of a forward spec, with the TE kernel's arguments and name:
    for "local" (q, k, v, dilation, [extra_idx], sink_logit, scale, out, lse) the window
    and extra keys of every row; for "global" (q_global, k, v, global_idx, sink_logit,
    scale, out, lse) the global rows against every key (causal: up to their position), a
    block of ``block_q`` global rows streaming every key chunk it can see."""
    if spec.kind not in ("local", "global"):
        raise ValueError(f"kernel {spec.name}: the flash kernel serves forward kernels, not {spec.kind!r}")
    cfg = config or default_config(spec)
    if cfg is None:
        raise ValueError(
            f"kernel {spec.name}: no flash tile of {spec.dtype} x head_dim {spec.head_dim} fits "
            f"{SHARED_BUDGET // 1024} KiB of shared memory"
        )
    cfg.check(spec.head_dim)
    func = _build(spec, cfg)
    return func.with_attr("global_symbol", spec.name)


def _build(spec: KernelSpec, cfg: FlashConfig):  # noqa: C901 - one kernel, phase by phase
    D, dt, acc = spec.head_dim, spec.dtype, accum_dtype(spec.dtype)
    lo, hi, maxd, extras = spec.left, spec.right, spec.max_dilation, spec.extras
    BQ, KC, NT = cfg.block_q, cfg.chunk, cfg.threads
    TX = cfg.thread_cols(D)
    TY = NT // TX
    RS, CS = BQ // TY, KC // TX  # score tile of a thread: rows x columns
    CA = D // TX  # value columns of a thread (rows: RS)
    # Flat tiles with padded rows (TVM would compact a 2-D tile's unused padding away).
    DP, SP = D + _pad(dt), KC + 1
    Q_STEPS, KV_STEPS = -(-BQ * D // NT), -(-KC * D // NT)
    load_extra_positions = extra_positions_loader(NT, KC)
    store_item, load_item = item_scalars(NT, BQ, lo, hi, KC)
    SH = "shared"
    NINF = tirx.const(float("-inf"), acc)
    ZERO, ONE = tirx.const(0.0, acc), tirx.const(1.0, acc)

    def f32(x):
        return x if dt == acc else T.Cast(acc, x)

    @T.macro
    def load_rows(Kt, Vt, src_k, src_v, b, kvh, pos_of, Tn):
        # Chunk rows kk of the key and value tiles, from sequence positions pos_of(kk)
        # (clamped: a row out of range is masked by the score phase).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for x in T.serial(KV_STEPS):
                e = T.meta_var(x * NT + tx)
                if e < KC * D:
                    kk = T.meta_var(e // D)
                    col = T.meta_var(e % D)
                    j = T.meta_var(clamp_row(pos_of(kk), Tn))
                    Kt[(kk) * DP + col] = src_k[b, kvh, j, col]
                    Vt[kk, col] = src_v[b, kvh, j, col]

    @T.macro
    def scores(Qs, Kt, S_s, sacc, visible, scale):
        # S = Q K^T over the chunk, one RS x CS register tile per thread, scaled and
        # masked (-inf); kept in the registers for `probabilities`, copied to S_s for the
        # row maxima.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CS):
                    sacc[tx, ii * CS + jj] = ZERO
            for cc in T.serial(D):
                for ii in T.unroll(RS):
                    for jj in T.unroll(CS):
                        sacc[tx, ii * CS + jj] = sacc[tx, ii * CS + jj] + f32(Qs[((tx // TX) * RS + ii) * DP + cc]) * f32(
                            Kt[(tx % TX + TX * jj) * DP + cc]
                        )
            for ii in T.unroll(RS):
                for jj in T.unroll(CS):
                    sacc[tx, ii * CS + jj] = T.Select(
                        visible((tx // TX) * RS + ii, tx % TX + TX * jj), sacc[tx, ii * CS + jj] * scale, NINF
                    )
                    S_s[((tx // TX) * RS + ii) * SP + tx % TX + TX * jj] = sacc[tx, ii * CS + jj]

    # Rows run on thread tx = row. Every phase only reads S_s or only writes it: a loop
    # that did both would make TVM want a barrier inside it (under the row test), which it
    # cannot place.
    @T.macro
    def row_max(S_s, m_s, a_s, red):
        # New running max, and the factor exp(m_old - m) by which old sums and values fade.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if tx < BQ:
                red[tx, 0] = m_s[tx]
                for j in T.serial(KC):
                    red[tx, 0] = fmax(red[tx, 0], S_s[(tx) * SP + j])
                # A row with no visible key yet keeps max -inf: factor 1, probabilities 0.
                a_s[tx] = T.Select(red[tx, 0] == NINF, ONE, T.exp(m_s[tx] - red[tx, 0]))
                m_s[tx] = red[tx, 0]

    @T.macro
    def probabilities(S_s, m_s, sacc):
        # P = exp(S - m), from the score tile still in the registers.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CS):
                    S_s[((tx // TX) * RS + ii) * SP + tx % TX + TX * jj] = T.Select(
                        m_s[(tx // TX) * RS + ii] == NINF, ZERO, T.exp(sacc[tx, ii * CS + jj] - m_s[(tx // TX) * RS + ii])
                    )

    @T.macro
    def row_sum(S_s, l_s, a_s, red):
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if tx < BQ:
                red[tx, 1] = ZERO
                for j in T.serial(KC):
                    red[tx, 1] = red[tx, 1] + S_s[(tx) * SP + j]
                l_s[tx] = l_s[tx] * a_s[tx] + red[tx, 1]

    @T.macro
    def softmax_step(S_s, m_s, l_s, a_s, red, sacc):
        row_max(S_s, m_s, a_s, red)
        probabilities(S_s, m_s, sacc)
        row_sum(S_s, l_s, a_s, red)

    @T.macro
    def accumulate(S_s, Vt, a_s, oacc, exact):
        # acc = acc * exp(m_old - m) + P V, one RS x CA register tile per thread. With
        # ``exact`` (``second_pass``), a value reaches a row only where its P is not 0: a
        # masked key's P is exactly 0, but 0 * NaN is NaN (the NaN rule: a key the row
        # does not see, or one the softmax gives nothing, adds nothing).
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for ii in T.unroll(RS):
                for jj in T.unroll(CA):
                    oacc[tx, ii * CA + jj] = oacc[tx, ii * CA + jj] * a_s[(tx // TX) * RS + ii]
            if not exact:
                for kk in T.serial(KC):
                    for ii in T.unroll(RS):
                        for jj in T.unroll(CA):
                            oacc[tx, ii * CA + jj] = oacc[tx, ii * CA + jj] + S_s[((tx // TX) * RS + ii) * SP + kk] * f32(
                                Vt[kk, tx % TX + TX * jj]
                            )
            else:
                for kk in T.serial(KC):
                    for ii in T.unroll(RS):
                        for jj in T.unroll(CA):
                            oacc[tx, ii * CA + jj] = oacc[tx, ii * CA + jj] + S_s[((tx // TX) * RS + ii) * SP + kk] * T.Select(
                                S_s[((tx // TX) * RS + ii) * SP + kk] == ZERO, ZERO, f32(Vt[kk, tx % TX + TX * jj])
                            )

    @T.macro
    def start_state(m_s, l_s, oacc, sink, h):
        # Each row's running max at the head's sink logit (-inf: none), its sum at that
        # sink's share, its outputs 0.
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if tx < BQ:
                m_s[tx] = sink[h]
                l_s[tx] = T.Select(sink[h] == NINF, ZERO, ONE)
            for ii in T.unroll(RS):
                for jj in T.unroll(CA):
                    oacc[tx, ii * CA + jj] = ZERO

    any_nonfinite = nonfinite_vote(NT, RS * CA)

    @T.macro
    def local_chunks(Qs, Kt, Vt, S_s, m_s, l_s, a_s, first_s, last_s, xpos_s, xres_s, xt_s, sacc, oacc, red, q, k, v, xidx,
                     scale, b, kvh, d, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi, Tn, E, exact):
        # The band chunks that meet the item's span, then the extra keys: every P V exact
        # with ``exact``, else as fast as they go (``second_pass``).
        for c in T.serial(c_begin, c_end):
            load_rows(Kt, Vt, k, v, b, kvh, band_positions(key0, d, c, KC), Tn)
            scores(
                Qs,
                Kt,
                S_s,
                sacc,
                # Chunks every row sees whole skip the per-score test (|| short-circuits).
                lambda row, col: T.Or(
                    chunk_inside(c, KC, inner_lo, inner_hi),
                    T.And(c * KC + col >= first_s[row], c * KC + col <= last_s[row]),
                ),
                scale,
            )
            softmax_step(S_s, m_s, l_s, a_s, red, sacc)
            accumulate(S_s, Vt, a_s, oacc, exact)
        if extras:
            for xc in T.serial((E + (KC - 1)) // KC):
                load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E)
                load_rows(Kt, Vt, k, v, b, kvh, lambda kk: xpos_s[kk], Tn)
                scores(
                    Qs,
                    Kt,
                    S_s,
                    sacc,
                    lambda row, col: extra_visible(
                        lo, hi, Tn, xpos_s[col], xres_s[col], xt_s[col], row0 + d * row, m0 + row, r
                    ),
                    scale,
                )
                softmax_step(S_s, m_s, l_s, a_s, red, sacc)
                accumulate(S_s, Vt, a_s, oacc, exact)

    @T.macro
    def body(q, k, v, dil, xidx, sink, scale, out, lse, B, H, Hkv, Tn, E):
        nitems = T.meta_var((Tn + (BQ - 1)) // BQ + (maxd - 1))
        for item in T.thread_binding(B * H * nitems, thread="blockIdx.x"):
            with T.sblock("flash"):
                T.reads()
                T.writes()
                Qs = T.alloc_buffer((BQ * DP,), dt, scope=SH)
                Kt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                Vt = T.alloc_buffer((KC, D), dt, scope=SH)
                S_s = T.alloc_buffer((BQ * SP,), acc, scope=SH)
                m_s = T.alloc_buffer((BQ,), acc, scope=SH)
                l_s = T.alloc_buffer((BQ,), acc, scope=SH)
                a_s = T.alloc_buffer((BQ,), acc, scope=SH)
                first_s = T.alloc_buffer((BQ,), "int64", scope=SH)
                last_s = T.alloc_buffer((BQ,), "int64", scope=SH)
                xpos_s = T.alloc_buffer((KC,), "int64", scope=SH)
                xres_s = T.alloc_buffer((KC,), "int64", scope=SH)
                xt_s = T.alloc_buffer((KC,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                oacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                red = T.alloc_buffer((NT, 2), acc, scope="local")
                fld = T.alloc_buffer((ITEM_SCALARS,), "int64", scope="local")
                nf_s = T.alloc_buffer((1,), "int32", scope=SH)  # the NaN rule's vote (``any_nonfinite``)
                nf = T.alloc_buffer((1,), "int32", scope="local")

                store_item(fld, item, H, Hkv, nitems, dil, Tn)
                b, h, beta, d, kvh, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi = T.meta_var(load_item(fld))
                # Items past the end (residue classes the head's dilation lacks) run with
                # every key masked and write nothing: a branch around the phases would put
                # barriers under a condition, which TVM rightly refuses.
                # 1. Rows: sink-initialised state, visible band intervals, queries.
                start_state(m_s, l_s, oacc, sink, h)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if tx < BQ:
                        first_s[tx] = row_key_range(lo, hi, Tn, d, m0, r, tx)[0]
                        last_s[tx] = row_key_range(lo, hi, Tn, d, m0, r, tx)[1]
                    if tx == 0:
                        nf_s[0] = 0
                    for x in T.serial(Q_STEPS):
                        e = T.meta_var(x * NT + tx)
                        if e < BQ * D:
                            qi = T.meta_var(e // D)
                            col = T.meta_var(e % D)
                            Qs[(qi) * DP + col] = q[b, h, T.min(row0 + d * qi, Tn - 1), col]
                # 2. The band, chunk by chunk, over the chunks that meet the item's span,
                # then the extra keys; again, exact, where the results came out non-finite.
                local_chunks(Qs, Kt, Vt, S_s, m_s, l_s, a_s, first_s, last_s, xpos_s, xres_s, xt_s, sacc, oacc, red, q, k,
                             v, xidx, scale, b, kvh, d, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi, Tn, E,
                             False)
                any_nonfinite(oacc, nf_s, nf)
                for once in T.serial(second_pass(nf)):
                    start_state(m_s, l_s, oacc, sink, h)
                    local_chunks(Qs, Kt, Vt, S_s, m_s, l_s, a_s, first_s, last_s, xpos_s, xres_s, xt_s, sacc, oacc, red, q,
                                 k, v, xidx, scale, b, kvh, d, m0, r, row0, key0, c_begin, c_end, inner_lo, inner_hi, Tn,
                                 E, True)
                # 3. Results to the item's rows.
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ii in T.unroll(RS):
                        for jj in T.unroll(CA):
                            if row0 + d * ((tx // TX) * RS + ii) < Tn:
                                out[b, h, row0 + d * ((tx // TX) * RS + ii), tx % TX + TX * jj] = T.Cast(
                                    dt, oacc[tx, ii * CA + jj] / l_s[(tx // TX) * RS + ii]
                                )
                    if tx < BQ:
                        if row0 + d * tx < Tn:
                            lse[b, h, row0 + d * tx] = m_s[tx] + T.log(l_s[tx])

    causal = spec.causal

    @T.macro
    def global_chunks(Qs, Kt, Vt, S_s, m_s, l_s, a_s, last_s, sacc, oacc, red, k, v, gidx, scale, b, kvh, g0, G, Tn,
                      exact):
        # Every key chunk up to the block's last visible key, each row masking the keys
        # past its own: every P V exact with ``exact`` (``second_pass``).
        for c in T.serial(T.floordiv(block_last_key(gidx, b, g0, G, Tn, BQ, causal), KC) + 1):
            load_rows(Kt, Vt, k, v, b, kvh, lambda kk: c * KC + kk, Tn)
            scores(Qs, Kt, S_s, sacc, lambda row, col: c * KC + col <= last_s[row], scale)
            softmax_step(S_s, m_s, l_s, a_s, red, sacc)
            accumulate(S_s, Vt, a_s, oacc, exact)

    @T.macro
    def global_body(qg, k, v, gidx, sink, scale, out, lse, B, H, Hkv, Tn, G):
        nblk = T.meta_var((G + (BQ - 1)) // BQ)
        for item in T.thread_binding(B * H * nblk, thread="blockIdx.x"):
            with T.sblock("flash_global"):
                T.reads()
                T.writes()
                Qs = T.alloc_buffer((BQ * DP,), dt, scope=SH)
                Kt = T.alloc_buffer((KC * DP,), dt, scope=SH)
                Vt = T.alloc_buffer((KC, D), dt, scope=SH)
                S_s = T.alloc_buffer((BQ * SP,), acc, scope=SH)
                m_s = T.alloc_buffer((BQ,), acc, scope=SH)
                l_s = T.alloc_buffer((BQ,), acc, scope=SH)
                a_s = T.alloc_buffer((BQ,), acc, scope=SH)
                last_s = T.alloc_buffer((BQ,), "int64", scope=SH)
                sacc = T.alloc_buffer((NT, RS * CS), acc, scope="local")
                oacc = T.alloc_buffer((NT, RS * CA), acc, scope="local")
                red = T.alloc_buffer((NT, 2), acc, scope="local")
                nf_s = T.alloc_buffer((1,), "int32", scope=SH)  # the NaN rule's vote (``any_nonfinite``)
                nf = T.alloc_buffer((1,), "int32", scope="local")

                b, h, g0, kvh = T.meta_var(global_fields(item, H, Hkv, nblk, BQ))
                # 1. Rows: sink-initialised state, last visible key (-1: a padding row past
                # G sees none), queries.
                start_state(m_s, l_s, oacc, sink, h)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if tx < BQ:
                        last_s[tx] = global_row_last_key(gidx, b, g0 + tx, G, Tn, causal)
                    if tx == 0:
                        nf_s[0] = 0
                    for x in T.serial(Q_STEPS):
                        e = T.meta_var(x * NT + tx)
                        if e < BQ * D:
                            Qs[(e // D) * DP + e % D] = qg[b, h, T.min(g0 + e // D, G - 1), e % D]
                # 2. Every key chunk up to the block's last visible key; again, exact, where
                # the results came out non-finite.
                global_chunks(Qs, Kt, Vt, S_s, m_s, l_s, a_s, last_s, sacc, oacc, red, k, v, gidx, scale, b, kvh, g0, G, Tn,
                              False)
                any_nonfinite(oacc, nf_s, nf)
                for once in T.serial(second_pass(nf)):
                    start_state(m_s, l_s, oacc, sink, h)
                    global_chunks(Qs, Kt, Vt, S_s, m_s, l_s, a_s, last_s, sacc, oacc, red, k, v, gidx, scale, b, kvh, g0, G,
                                  Tn, True)
                # 3. Results to the block's global rows.
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ii in T.unroll(RS):
                        for jj in T.unroll(CA):
                            if g0 + (tx // TX) * RS + ii < G:
                                out[b, h, g0 + (tx // TX) * RS + ii, tx % TX + TX * jj] = T.Cast(
                                    dt, oacc[tx, ii * CA + jj] / l_s[(tx // TX) * RS + ii]
                                )
                    if tx < BQ:
                        if g0 + tx < G:
                            lse[b, h, g0 + tx] = m_s[tx] + T.log(l_s[tx])

    if spec.kind == "global":
        return global_kernel(global_body, D, dt, acc)
    return local_kernel(body, D, dt, acc, extras)


def extra_positions_loader(threads: int, chunk: int):
    """A T.macro filling chunk ``xc`` of the extra keys' shared tables: position (-1
    past E), residue and residue-space index under dilation ``d``, for ``threads``
    threads and ``chunk`` keys per chunk."""
    steps = -(-chunk // threads)

    @T.macro
    def load_extra_positions(xpos_s, xres_s, xt_s, xidx, b, xc, d, E):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for x in T.serial(steps):
                kk = T.meta_var(x * threads + tx)
                if kk < chunk:
                    xpos_s[kk] = T.Select(
                        xc * chunk + kk < E, T.Cast("int64", xidx[b, T.min(xc * chunk + kk, E - 1)]), T.int64(-1)
                    )
                    xres_s[kk] = T.floormod(xpos_s[kk], d)
                    xt_s[kk] = T.floordiv(xpos_s[kk], d)

    return load_extra_positions


def global_row_last_key(gidx, b, g, G, Tn, causal: bool):
    """The last key global row ``g`` sees: its position (causal) or T - 1; -1 for a
    padding row past G, which sees none."""
    return T.Select(
        g < G, T.min(T.Cast("int64", gidx[b, T.min(g, G - 1)]), Tn - 1) if causal else Tn - 1, T.int64(-1)
    )


def block_last_key(gidx, b, g0, G, Tn, rows: int, causal: bool):
    """The last key a block of ``rows`` global rows from ``g0`` sees: the largest of
    their ``global_row_last_key`` (T - 1 when not causal). One expression over the
    block's positions, not a loop: TVM allows no shared-memory read in a loop bound and
    no barrier under a thread test."""
    if not causal:
        return Tn - 1
    return functools.reduce(T.max, [global_row_last_key(gidx, b, g0 + row, G, Tn, True) for row in range(rows)])


def block_inner_last_key(gidx, b, g0, G, Tn, rows: int, causal: bool):
    """The last key every valid row (< G) of a block of ``rows`` global rows from ``g0``
    sees, all keys up to it: the smallest of their ``global_row_last_key`` (T - 1 when
    not causal). Row g0 is valid in every block."""
    if not causal:
        return Tn - 1
    return functools.reduce(
        T.min, [T.Select(g0 + row < G, global_row_last_key(gidx, b, g0 + row, G, Tn, True), Tn - 1) for row in range(rows)]
    )


def global_fields(item, H, Hkv, nblk, block: int):
    """A global-rows work item's coordinates: batch b, head h, the block's first global
    row g0, kv head."""
    b = T.truncdiv(item, H * nblk)
    h = T.truncmod(T.truncdiv(item, nblk), H)
    return b, h, T.truncmod(item, nblk) * block, T.truncdiv(h, T.truncdiv(H, Hkv))


def split_item_fields(threads: int, rows: int, chunk: int, causal: bool):
    """A T.macro ``store(fld, item, S, H, Hkv, nblk, gidx, G, Tn)`` for a split-K global
    rows' work item (a block of ``rows`` rows, piece s of S): fld[0..6] = b, h, g0, kvh,
    s, and the piece's chunks c_begin..c_end (the block's chunks of ``chunk`` keys up to
    its last visible key, in S pieces of ceil(n / S), the last ones possibly empty),
    each thread's copy (held in registers)."""

    @T.macro
    def store(fld, item, S, H, Hkv, nblk, gidx, G, Tn):
        f = T.meta_var(global_fields(T.truncdiv(item, S), H, Hkv, nblk, rows))
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            fld[0] = f[0]
            fld[1] = f[1]
            fld[2] = f[2]
            fld[3] = f[3]
            fld[4] = T.truncmod(item, S)
            fld[6] = T.floordiv(block_last_key(gidx, fld[0], fld[2], G, Tn, rows, causal), chunk) + 1
            fld[5] = T.min(fld[4] * T.truncdiv(fld[6] + S - 1, S), fld[6])
            fld[6] = T.min(fld[5] + T.truncdiv(fld[6] + S - 1, S), fld[6])

    return store


def second_pass(nf):
    """The extent of a loop that runs once where nf[0] (a work item's vote, the same in
    every thread) is set, else not at all: the branch around an item's second, exact
    computation (the NaN rule), as a loop because TVM places barriers in loops but in
    no branch.

    The NaN rule: a key a row does not see adds nothing to it, whatever its k or v hold
    (NaN, +-inf); nor does one the softmax gives a weight of exactly 0. The fast products
    multiply masked keys by a weight of 0, and 0 * NaN is NaN: such a value leaves NaN in
    the row's results, where nothing takes it out again (NaN stays NaN through every
    rescale and sum). So the chunk loops run as they always have, and a work item whose
    results come out non-finite (from such a value, or from one its rows see: NaN
    either way) is computed again after them, every product exact (a weight of 0 adds
    nothing). Finite data pays one test of each result and a block-wide vote per item,
    outside the chunk loops; non-finite data about twice the work, for the items that
    meet it."""
    return T.Select(nf[0] != 0, 1, 0)


def nonfinite_vote(threads: int, count: int):
    """A T.macro ``vote(acc, nf_s, nf)``: nf[0] = 1 in every thread if any of the
    registers acc[tx, 0 .. count - 1] of any thread is NaN or +-inf (nf_s: a shared
    int32, 0 before, where the threads vote): the NaN rule's test (``second_pass``)."""

    @T.macro
    def vote(acc, nf_s, nf):
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            for x in T.unroll(count):
                if T.Not(T.isfinite(acc[tx, x])):
                    nf_s[0] = 1
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            nf[0] = nf_s[0]

    return vote


def fmax(a, b):
    """The larger of two fp32 values as CUDA's fmaxf takes it (what TIR's max of floats
    becomes on the GPU): a NaN operand gives the other. On the CPU TIR's max is a
    compare and select, NaN kept or dropped by operand order; the serial CPU runs must
    not differ from the GPU there. A NaN score the max passes over still reaches its row
    through its probability, exp(NaN - m)."""
    return T.call_pure_extern("float32", "fmaxf", a, b)


def clamp_row(pos, n):
    """Position ``pos`` clamped to [0, n), in pos's own dtype (int32 positions clamp in
    two instructions, int64 ones in eight)."""
    return T.max(T.min(pos, T.Cast(str(pos.ty), n) - 1), tirx.const(0, str(pos.ty)))


def band_positions(key0, d, c, chunk: int):
    """Sequence positions of band chunk c's keys, kk -> key0 + d*(c*chunk + kk), in int32
    (a sequence shorter than 2^31; int64 index arithmetic costs twice the instructions),
    the chunk's first position once."""
    return lambda kk: T.Cast("int32", key0 + d * c * chunk) + T.Cast("int32", d) * kk


def chunk_inside(c, chunk: int, inner_lo, inner_hi):
    """Whether every row of an item sees all of its band chunk c (band indices
    c*chunk .. + chunk - 1 within the item's inner span, ``item_scalars``): no mask there."""
    return T.And(c * chunk >= inner_lo, c * chunk + (chunk - 1) <= inner_hi)


def item_fields(item, H, Hkv, nitems, dil, block: int, lo: int):
    """The work item's coordinates, as index expressions: batch b, head h, item beta,
    dilation d (int64), kv head, m0 (the item's first row in residue space), residue r,
    row0 (its first sequence position), key0 (the position of band index 0).

    Every operand is >= 0, so truncating division (one instruction) equals floor
    division (sign fix-ups in every index)."""
    b = T.truncdiv(item, H * nitems)
    h = T.truncmod(T.truncdiv(item, nitems), H)
    beta = T.truncmod(item, nitems)
    d = T.Cast("int64", dil[h])
    kvh = T.truncdiv(h, T.truncdiv(H, Hkv))
    m0 = T.truncdiv(beta, d) * block
    r = T.truncmod(beta, d)
    row0 = m0 * d + r
    key0 = (row0 - lo * d) if lo >= 0 else r
    return b, h, beta, d, kvh, m0, r, row0, key0


# The slots of a work item's scalars (``item_scalars``).
ITEM_SCALARS = 13


def item_scalars(threads: int, block: int, lo: int, hi: int, chunk: int):
    """A T.macro ``store(fld, item, H, Hkv, nitems, dil, Tn)`` that computes a work
    item's scalars once into each thread's ``fld`` (a local int64 buffer of
    ITEM_SCALARS), and ``load(fld)``, the tuple of their loads: ``item_fields``'s b, h,
    beta, d, kvh, m0, r, row0, key0; the chunks c_begin <= c < c_end (of ``chunk`` band
    keys) that meet the item's key span; the band indices inner_lo..inner_hi every row
    sees (``item_inner_span``).

    Why: left as index expressions of blockIdx, they are re-evaluated where used, in the
    chunk loop: int64 divisions by H*nitems, nitems and the runtime dilation as often as
    the tensor-core products, in the H200 profile of bench/gpu."""

    @T.macro
    def store(fld, item, H, Hkv, nitems, dil, Tn):
        f = T.meta_var(item_fields(item, H, Hkv, nitems, dil, block, lo))
        for tx in T.thread_binding(threads, thread="threadIdx.x"):
            fld[0] = f[0]
            fld[1] = f[1]
            fld[2] = f[2]
            fld[3] = f[3]
            fld[4] = f[4]
            fld[5] = f[5]
            fld[6] = f[6]
            fld[7] = f[7]
            fld[8] = f[8]
            fld[9] = T.floordiv(item_key_span(lo, hi, block, Tn, fld[3], fld[2])[0], chunk)
            fld[10] = T.floordiv(item_key_span(lo, hi, block, Tn, fld[3], fld[2])[1], chunk) + 1
            fld[11] = item_inner_span(lo, hi, block, Tn, fld[3], fld[5], fld[6])[0]
            fld[12] = item_inner_span(lo, hi, block, Tn, fld[3], fld[5], fld[6])[1]

    def load(fld):
        return tuple(fld[i] for i in range(ITEM_SCALARS))

    return store, load


def local_kernel(body, D: int, dt: str, acc: str, extras: bool):
    """The PrimFunc of a local forward kernel with the TE kernel's arguments: q, k, v,
    dilation, [extra_idx], sink_logit, scale, out, lse; ``body`` is the T.macro that
    computes it from those buffers and the shape vars B, H, Hkv, T, E."""
    if extras:

        @T.prim_func(s_tir=True)
        def kernel_x(
            q_h: T.handle,
            k_h: T.handle,
            v_h: T.handle,
            dil_h: T.handle,
            x_h: T.handle,
            sink_h: T.handle,
            scale: T.float32,
            out_h: T.handle,
            lse_h: T.handle,
        ):
            B, H, Hkv, Tn, E = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (B, H, Tn, D), dt)
            k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
            v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
            dil = T.match_buffer(dil_h, (H,), "int32")
            xidx = T.match_buffer(x_h, (B, E), "int32")
            sink = T.match_buffer(sink_h, (H,), acc)
            out = T.match_buffer(out_h, (B, H, Tn, D), dt)
            lse = T.match_buffer(lse_h, (B, H, Tn), acc)
            body(q, k, v, dil, xidx, sink, scale, out, lse, B, H, Hkv, Tn, E)

        return kernel_x

    @T.prim_func(s_tir=True)
    def kernel(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        dil_h: T.handle,
        sink_h: T.handle,
        scale: T.float32,
        out_h: T.handle,
        lse_h: T.handle,
    ):
        B, H, Hkv, Tn = T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (B, H, Tn, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        dil = T.match_buffer(dil_h, (H,), "int32")
        sink = T.match_buffer(sink_h, (H,), acc)
        out = T.match_buffer(out_h, (B, H, Tn, D), dt)
        lse = T.match_buffer(lse_h, (B, H, Tn), acc)
        body(q, k, v, dil, None, sink, scale, out, lse, B, H, Hkv, Tn, T.int64(0))

    return kernel


def global_kernel(body, D: int, dt: str, acc: str):
    """The PrimFunc of a global-rows forward kernel with the TE kernel's arguments:
    q_global, k, v, global_idx, sink_logit, scale, out, lse; ``body`` is the T.macro that
    computes it from those buffers and the shape vars B, H, Hkv, T, G."""

    @T.prim_func(s_tir=True)
    def kernel_g(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, sink_h: T.handle,
        scale: T.float32, out_h: T.handle, lse_h: T.handle,
    ):
        B, H, Hkv, Tn, G = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qg = T.match_buffer(q_h, (B, H, G, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        gidx = T.match_buffer(g_h, (B, G), "int32")
        sink = T.match_buffer(sink_h, (H,), acc)
        out = T.match_buffer(out_h, (B, H, G, D), dt)
        lse = T.match_buffer(lse_h, (B, H, G), acc)
        body(qg, k, v, gidx, sink, scale, out, lse, B, H, Hkv, Tn, G)

    return kernel_g


def global_split_kernel(body, D: int, dt: str, acc: str):
    """``global_kernel``'s PrimFunc with the arguments of ``library.GLOBAL_WORKSPACE``
    after lse; ``body`` gets them and S after the shape vars."""

    @T.prim_func(s_tir=True)
    def kernel_gs(
        q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, sink_h: T.handle,
        scale: T.float32, out_h: T.handle, lse_h: T.handle, ws_o_h: T.handle, ws_lse_h: T.handle,
    ):
        B, H, Hkv, Tn, G, S = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qg = T.match_buffer(q_h, (B, H, G, D), dt)
        k = T.match_buffer(k_h, (B, Hkv, Tn, D), dt)
        v = T.match_buffer(v_h, (B, Hkv, Tn, D), dt)
        gidx = T.match_buffer(g_h, (B, G), "int32")
        sink = T.match_buffer(sink_h, (H,), acc)
        out = T.match_buffer(out_h, (B, H, G, D), dt)
        lse = T.match_buffer(lse_h, (B, H, G), acc)
        ws_o = T.match_buffer(ws_o_h, (B, H, S, G, D), "float32")
        ws_lse = T.match_buffer(ws_lse_h, (B, H, S, G), "float32")
        body(qg, k, v, gidx, sink, scale, out, lse, ws_o, ws_lse, B, H, Hkv, Tn, G, S)

    return kernel_gs
