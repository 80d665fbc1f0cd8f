"""The decision run's summary (tools/gpu_decide.sh): from ``<out>/gpu_results.json``
and ``<out>/flex_ablation.json``, the numbers the Hopper forward's design turns on and
which outcome they fall under (docs/cuda.md, "The decision run"):

- ``descriptors``: a wgmma probe disagrees with its product (or the exchanged reading
  agrees): wgmma's shared-memory descriptors are read otherwise than built; fix them
  before any wgmma timing counts;
- ``wgmma default``: a wgmma forward agreeing with the default kernels runs faster
  than FlexAttention at the bar shape: it becomes the default, tuned around;
- ``wgmma behind``: wgmma forwards agree but none beats FlexAttention: the stall
  reasons in ncu_best.txt beside ncu_flex.txt say what is next (barrier stalls: two
  warpgroups in ping-pong; memory stalls: TMA and deeper stages, as the ablation
  prices them for Flex);
- ``no wgmma``: no wgmma forward ran and agreed: its rows' errors say why.

Usage: ``python3 -m tools.gpu_summary $OUT``.
"""

from __future__ import annotations

import json
import os
import sys


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def outcome(results: dict) -> str:
    """The decision ``results`` (gpu_results.json) fall under (see the module's doc)."""
    rows = [r for r in results.get("variants") or [] if isinstance(r, dict)]
    probes = [r for r in rows if r.get("kind") == "wgmma_probe"]
    if any("agrees" in p and p["agrees"] == bool(p.get("swap")) for p in probes):
        return "descriptors"
    causal = next((t for t in results.get("timing") or [] if isinstance(t, dict) and t.get("config") == "causal"), {})
    flex_ms = causal.get("flex_attention_ms")
    from tools.gpu_profile import pick_best

    best = pick_best({**results, "variants": [r for r in rows if r.get("wgmma")]})
    if best is None:
        return "no wgmma"
    ms = next(r["ms"] for r in rows if r.get("function", "").endswith("__" + best))
    return "wgmma default" if flex_ms and ms < flex_ms else "wgmma behind"


def summary(out: str) -> list[str]:
    r = _load(os.path.join(out, "gpu_results.json"))
    lines = [f"device {r.get('device')}, torch {r.get('torch')}, matmul {r.get('matmul_tflops') or 0:.0f} TFLOP/s, "
             f"ok {r.get('ok')}"]
    for t in r.get("timing") or []:
        if isinstance(t, dict):
            lines.append(f"  bar {t.get('config'):11s} ours {t.get('ours_ms', float('nan')):7.2f} ms  flex "
                         f"{t.get('flex_attention_ms', float('nan')):7.2f} ms  x{t.get('speedup_vs_flex_attention', float('nan')):.2f}")
    rows = [x for x in r.get("variants") or [] if isinstance(x, dict)]
    for p in (x for x in rows if x.get("kind") == "wgmma_probe"):
        lines.append(f"  probe {p['function']}: agrees {p.get('agrees')} {p.get('error', '')}".rstrip())
    fwd = sorted((x for x in rows if x.get("kind", "local") == "local" and "ms" in x), key=lambda x: x["ms"])
    for x in fwd[:10]:
        lines.append(f"  {x['function'].split('__')[-1]:32s} {16 * x.get('warps', 0) * x.get('m_tiles', 1):4d} rows "
                     f"{x['ms']:7.2f} ms x{x.get('speedup_vs_flex_attention', float('nan')):.2f} flex "
                     f"err {x.get('rel_err_vs_default', float('nan')):.1e}{' default' if x.get('default') else ''}")
    failed = [x for x in rows if "error" in x]
    lines.append(f"  variant rows {len(rows)}, failed {len(failed)}"
                 + "".join(f"\n    {x.get('function')}: {str(x['error'])[:120]}" for x in failed[:8]))
    a = _load(os.path.join(out, "flex_ablation.json"))
    for x in a.get("rows") or []:
        lines.append(f"  flex {x.get('config'):18s} {x.get('ms', float('nan')):7.2f} ms {x.get('tflops', float('nan')):6.0f} "
                     f"TFLOP/s {x.get('error', '')}".rstrip())
    lines.append(f"outcome: {outcome(r)}")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(sys.argv[1] if len(sys.argv) > 1 else ".")))
