"""MetaSchedule builder whose worker processes outlive a batch.

MetaSchedule's ``LocalBuilder`` starts a fresh process pool for every ``build`` call (and
one more for its constructor's sanity check), and each worker imports TVM and then
``tvm.s_tir.tensor_intrin`` before it compiles anything: about 12 s per batch on two
cores, against ~0.4 s to compile one of our CPU candidates. Here the pool is started
once per builder and each worker is recycled after ``max_uses`` builds. (Upstream
restarts per batch for a worker memory leak; our CPU candidates showed none: a worker
held 436-439 MiB over 64 builds of D=64 W=256 kernels, 2026-12-05. The recycling bounds
what was not measured, CUDA candidates among it.) Candidates arrive scheduled,
tensorized where their schedule tensorizes, so a worker needs the compiler only: it
never imports ``tensor_intrin``.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import get_global_func
from tvm.driver import build
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind


def build_candidate(mod, target):
    """Compile one scheduled candidate, as MetaSchedule's ``default_build`` does minus
    its ``tensor_intrin`` import."""
    return build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


# MetaSchedule's tar export: a registered global, looked up in the worker (the function
# object itself does not pickle).
DEFAULT_EXPORT = "s_tir.meta_schedule.builder.default_export"


def _warm_up() -> None:
    """Nothing: calling it in a worker imports this module there, and with it what a
    build needs, so that the first batch does not wait for it."""


def _build_and_export(f_export: Callable | str, mod, target) -> str:
    if isinstance(f_export, str):
        f_export = get_global_func(f_export)
    return f_export(build_candidate(mod, target))


@derived_object
class PooledBuilder(PyBuilder):
    """``LocalBuilder``'s results (``BuilderResult`` with an artifact path or the error)
    from one process pool kept across batches. ``f_export``: rt module -> artifact path
    (MetaSchedule's tar by default). Call ``close()`` when done."""

    def __init__(self, *, max_workers: int, timeout_sec: float, f_export: Callable | None = None,
                 max_uses: int = 32) -> None:
        super().__init__()
        self.timeout_sec = timeout_sec
        self.f_export = f_export or DEFAULT_EXPORT
        self._pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec, maximum_process_uses=max_uses)
        # One job per thread submitted at once: each thread starts its worker process now,
        # while the caller goes on (a worker takes seconds to import TVM).
        for _ in range(max_workers):
            self._pool.submit(_warm_up)

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        results = []
        jobs = [(self.f_export, b.mod, b.target) for b in build_inputs]
        for r in self._pool.map_with_error_catching(lambda job: _build_and_export(*job), jobs):
            if r.status == StatusKind.COMPLETE:
                results.append(BuilderResult(r.value, None))
            elif r.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"builder: timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(BuilderResult(None, "builder: an exception occurred\n" + str(r.value)))
        return results

    def close(self) -> None:
        """Stop the workers (``PopenPoolExecutor`` warns against leaving it to the GC)."""
        self._pool.shutdown()
