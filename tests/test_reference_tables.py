"""The mask builder and the kernels against seed 003's hand-traced tables (n=16, r=2).

003 states totals of 74 (dilated) and 126 (global) that do not match its own row tables;
the rows are authoritative and sum to 68 and 120, which is what is tested here.
"""

import torch

import swa_tvm
from swa_tvm.reference import attention_mask

N = 16

WINDOW_ROWS = {
    0: {0, 1, 2}, 1: {0, 1, 2, 3}, 2: {0, 1, 2, 3, 4}, 3: {1, 2, 3, 4, 5}, 4: {2, 3, 4, 5, 6},
    **{i: set(range(i - 2, i + 3)) for i in range(5, 13)},
    13: {11, 12, 13, 14, 15}, 14: {12, 13, 14, 15}, 15: {13, 14, 15},
}  # fmt: skip
DILATED_ROWS = {
    0: {0, 2, 4}, 1: {1, 3, 5}, 2: {0, 2, 4, 6}, 3: {1, 3, 5, 7}, 4: {0, 2, 4, 6, 8},
    5: {1, 3, 5, 7, 9}, 6: {2, 4, 6, 8, 10}, 7: {3, 5, 7, 9, 11}, 8: {4, 6, 8, 10, 12},
    9: {5, 7, 9, 11, 13}, 10: {6, 8, 10, 12, 14}, 11: {7, 9, 11, 13, 15}, 12: {8, 10, 12, 14},
    13: {9, 11, 13, 15}, 14: {10, 12, 14}, 15: {11, 13, 15},
}  # fmt: skip
ALL = set(range(16))
GLOBAL_ROWS = {
    0: ALL, 1: {0, 1, 2, 3, 8}, 2: {0, 1, 2, 3, 4, 8}, 3: {0, 1, 2, 3, 4, 5, 8},
    4: {0, 2, 3, 4, 5, 6, 8}, 5: {0, 3, 4, 5, 6, 7, 8}, 6: {0, 4, 5, 6, 7, 8}, 7: {0, 5, 6, 7, 8, 9},
    8: ALL, 9: {0, 7, 8, 9, 10, 11}, 10: {0, 8, 9, 10, 11, 12}, 11: {0, 8, 9, 10, 11, 12, 13},
    12: {0, 8, 10, 11, 12, 13, 14}, 13: {0, 8, 11, 12, 13, 14, 15}, 14: {0, 8, 12, 13, 14, 15},
    15: {0, 8, 13, 14, 15},
}  # fmt: skip


def _rows(mask):
    return {i: set(torch.nonzero(mask[i]).flatten().tolist()) for i in range(N)}


def _kernel_visible(**kw):
    """Which keys the kernel gives weight to: with v = identity, out[i, j] = P[i, j]."""
    q = torch.randn(1, 1, N, N)
    k = torch.randn(1, 1, N, N)
    v = torch.eye(N).view(1, 1, N, N)
    out = swa_tvm.sliding_window_attention(q, k, v, **kw)[0, 0]
    assert torch.allclose(out.sum(-1), torch.ones(N), atol=1e-5)
    return {i: set(torch.nonzero(out[i] > 0).flatten().tolist()) for i in range(N)}


def test_window_table():
    mask, _ = attention_mask(N, 1, (2, 2), 1)
    assert _rows(mask[0, 0]) == WINDOW_ROWS
    assert int(mask.sum()) == 74 == sum(len(s) for s in WINDOW_ROWS.values())
    assert _kernel_visible(window_size=(2, 2)) == WINDOW_ROWS


def test_dilated_table():
    mask, _ = attention_mask(N, 1, (2, 2), 2)
    assert _rows(mask[0, 0]) == DILATED_ROWS
    assert int(mask.sum()) == 68  # 003 says 74; its rows sum to 68
    assert _kernel_visible(window_size=(2, 2), dilation=2) == DILATED_ROWS


def test_global_table():
    gi = torch.tensor([[0, 8]], dtype=torch.int32)
    mask, is_global = attention_mask(N, 1, (2, 2), 1, gi)
    assert _rows(mask[0, 0]) == GLOBAL_ROWS
    assert int(mask.sum()) == 120  # 003 says 126; its rows sum to 120
    assert is_global[0].nonzero().flatten().tolist() == [0, 8]
    assert _kernel_visible(window_size=(2, 2), global_idx=gi) == GLOBAL_ROWS


def test_causal_mistral_window():
    # Mistral's W=3: keys t-3 < s <= t, i.e. window (2, 0).
    mask, _ = attention_mask(N, 1, (2, 0), 1)
    want = {i: set(range(max(0, i - 2), i + 1)) for i in range(N)}
    assert _rows(mask[0, 0]) == want
    assert _kernel_visible(window_size=(2, 0)) == want


def test_causal_globals_and_sinks_never_see_the_future():
    gi = torch.tensor([[3, 9]], dtype=torch.int32)
    vis = _kernel_visible(window_size=(1, 0), global_idx=gi, num_sinks=2)
    for i, keys in vis.items():
        assert max(keys) <= i
        assert {j for j in (0, 1, 3, 9) if j <= i} <= keys
    assert vis[9] == set(range(10))  # a causal global row sees every earlier key
