"""MetaSchedule tuning: the search space replays on the symbolic kernel and computes the
right answer, the logs survive kills, a rerun continues, export applies records only to
their own CPU class, and an RPC tracker with two servers measures candidates.

Tuning stays tiny here (a D=16 kernel, 2-4 trials): one batch of full-size candidates
takes minutes to build on two cores."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import swa_tvm
from swa_tvm.compiler import records
from swa_tvm.tuning import tune
from swa_tvm.compiler.targets import host_target, target_key
from swa_tvm.reference import sliding_window_attention_ref
from swa_tvm.spec import CPU_ONLY_KINDS, AttentionSpec, KernelSpec

from conftest import check_against_reference, rel_err, run_cli

SPEC_STR = "head_dim=16,window=7:0"
SPEC = AttentionSpec.parse(SPEC_STR)
KSPEC = SPEC.kernels()[0]
CLI = [sys.executable, "-m", "swa_tvm.cli"]

# MetaSchedule runs, subprocesses and an RPC tracker: `make test`, not `make check`.
pytestmark = pytest.mark.slow


def _compile_one(func):
    import tvm

    return tvm.compile(tvm.IRModule({func.attrs["global_symbol"]: func}), target=tvm.target.Target(host_target()))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_schedules_replay_on_symbolic_kernel_and_are_correct(seed):
    """A random point of the search space, sampled on the concrete tuning workload and
    replayed on the symbolic-T kernel (what export does with a record), is correct at
    shapes other than the tuning shape."""
    import tvm
    from tvm import s_tir

    from swa_tvm.compiler.targets import _vector_lanes
    from swa_tvm.schedules import cpu

    spec = KernelSpec("local", 16, "float32", 5, 2, 2, True, 16)
    sch = s_tir.Schedule(records.tuning_workload(spec), seed=seed)
    cpu.schedule(sch, spec, _vector_lanes(tvm.target.Target(host_target())), cpu.Sampled())
    assert any(i.kind.name in ("SamplePerfectTile", "SampleCategorical") for i in sch.trace.insts)
    func = records.apply_record(spec, sch.trace)
    f = _compile_one(func)[spec.name]

    B, H, T, D = 2, 3, 77, 16  # E = 3 extra key slots per batch row
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    dil = torch.tensor([1, 2, 2], dtype=torch.int32)
    extra = torch.tensor([[0, 40, -1], [5, 6, 70]], dtype=torch.int32)
    out, lse = torch.empty(B, H, T, D), torch.empty(B, H, T)
    f(q, k, v, dil, extra, torch.full((H,), float("-inf")), D**-0.5, out, lse)
    # The local kernel's contract: each row sees its dilated window plus the extra key
    # positions of its batch row (-1 = unused); right > 0, so no causal cut.
    from swa_tvm.reference import window_mask

    ref_out = torch.empty(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        cols = torch.zeros(T, dtype=torch.bool)
        cols[extra[b][extra[b] >= 0].long()] = True
        for h in range(H):
            m = window_mask(T, 5, 2, int(dil[h])) | cols.view(1, T)
            s = (q[b, h].double() @ k[b, h].double().T) * D**-0.5
            ref_out[b, h] = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ v[b, h].double()
    assert rel_err(out, ref_out) < 1e-5


def _tune_cmd(logs, work, trials, per_iter, *extra):
    return CLI + ["tune", "--spec", SPEC_STR, "--trials", str(trials), "--trials-per-iter", str(per_iter),
                  "--logs", str(logs), "--work-dir", str(work), "--seed", "0", "--quiet", *extra]  # fmt: skip


def _record_lines(folder):
    path = os.path.join(folder, records.RECORD_FILE)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _check_logs_readable(folder):
    """TVM's own JSONDatabase and ours both read every line."""
    from tvm.s_tir.meta_schedule.database import JSONDatabase

    db = JSONDatabase(
        os.path.join(folder, records.WORKLOAD_FILE), os.path.join(folder, records.RECORD_FILE), allow_missing=False
    )
    n = len(db.get_all_tuning_records())
    assert n == _record_lines(folder) == len(records.open_log(folder, readonly=True))
    return n


@pytest.fixture(scope="module")
def tuned_logs(tmp_path_factory):
    """Tune, SIGKILL mid-run, check the logs, continue with a second run."""
    logs = tmp_path_factory.mktemp("logs")
    work = tmp_path_factory.mktemp("work")
    folder = records.log_dir(str(logs), host_target())
    # 40 trials: far more than are measured before the kill (a short run could end first
    # on a busy machine: pytest's other worker shares the cores).
    p = subprocess.Popen(_tune_cmd(logs, work, 40, 2), start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.time() + 400
    while _record_lines(folder) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
    assert p.poll() is None, "tune ended before it could be killed:\n" + p.stdout.read().decode()
    os.killpg(p.pid, signal.SIGKILL)  # the tuner and its builder/runner workers
    p.wait()
    killed = _check_logs_readable(folder)
    assert killed >= 2

    r = subprocess.run(_tune_cmd(logs, work, 2, 2), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    after = _check_logs_readable(folder)
    assert after >= killed + 2, (killed, after, r.stdout)
    assert f"{KSPEC.name}: {after} records (+" in r.stdout
    return logs


def test_builder_keeps_its_workers_across_batches_and_reports_failures():
    """tuning_builder.PooledBuilder: the second batch is built by the first batch's
    worker processes (MetaSchedule's LocalBuilder started new ones per batch), a
    candidate that does not compile comes back as that candidate's error, and the
    others of its batch still build."""
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    from swa_tvm.tuning.builder import PooledBuilder

    good = records.default_point(KSPEC, 8).mod
    n, a = te.var("n"), te.placeholder((64,), name="a")  # n: used, not an argument
    broken = tvm.IRModule({"main": te.create_prim_func([a, te.compute((64,), lambda i: a[i] * n.astype("float32"))])})
    cpu = tvm.target.Target(host_target())
    # The "artifact" is the worker's pid (a lambda: cloudpickle sends it by value).
    builder = PooledBuilder(max_workers=2, timeout_sec=120, f_export=lambda mod: str(__import__("os").getpid()))
    try:
        first = builder.build([ms.builder.BuilderInput(good, cpu), ms.builder.BuilderInput(good, cpu)])
        second = builder.build([ms.builder.BuilderInput(broken, cpu), ms.builder.BuilderInput(good, cpu)])
    finally:
        builder.close()
    assert all(r.error_msg is None for r in first)
    pids = {int(r.artifact_path) for r in first}
    assert os.getpid() not in pids
    assert second[0].artifact_path is None and "builder: an exception occurred" in second[0].error_msg
    assert "variables (n,) are used, but are not passed" in second[0].error_msg  # TVM's reason, passed on
    assert second[1].error_msg is None and int(second[1].artifact_path) in pids


def test_sampled_schedule_of_a_bfloat16_kernel_is_correct():
    """The CPU search space of a bfloat16 kernel (float32 inside): a sampled point,
    replayed on the symbolic kernel, against the float64 reference."""
    import tvm
    from tvm import s_tir

    from swa_tvm.compiler.targets import _vector_lanes
    from swa_tvm.schedules import cpu

    spec = KernelSpec("local", 16, "bfloat16", 5, 0, 1, False, 16)
    sch = s_tir.Schedule(records.tuning_workload(spec), seed=4)
    cpu.schedule(sch, spec, _vector_lanes(tvm.target.Target(host_target())), cpu.Sampled())
    assert any(i.kind.name in ("SamplePerfectTile", "SampleCategorical") for i in sch.trace.insts)
    f = _compile_one(records.apply_record(spec, sch.trace))[spec.name]
    B, H, T, D = 2, 3, 77, 16
    q, k, v = (torch.randn(B, H, T, D).to(torch.bfloat16) for _ in range(3))
    out, lse = torch.empty(B, H, T, D, dtype=torch.bfloat16), torch.empty(B, H, T)
    f(q, k, v, torch.ones(H, dtype=torch.int32), torch.full((H,), float("-inf")), D**-0.5, out, lse)
    ref, ref_lse = sliding_window_attention_ref(q, k, v, window_size=(5, 0))
    assert rel_err(out, ref) < 2e-2 and (lse.double() - ref_lse).abs().max() < 1e-4


def test_interrupt_keeps_records_and_exits_130(tmp_path):
    """Ctrl-C: exit 130, every record kept, and no builder or runner worker left running
    (the tune has its own process group; the workers leave it only by exiting)."""
    folder = records.log_dir(str(tmp_path / "logs"), host_target())
    p = subprocess.Popen(_tune_cmd(tmp_path / "logs", tmp_path / "work", 40, 2),  # interrupted long before its end
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.time() + 400
    while _record_lines(folder) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    assert "interrupted" in err and "run the same command again" in err
    assert _check_logs_readable(folder) >= 2
    deadline = time.time() + 30  # a worker sees its pipe close and exits
    while time.time() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("worker processes outlived the interrupted tune")


def test_export_applies_records_and_result_is_correct(tuned_logs, tmp_path, fresh_registry, capsys):
    lib = tmp_path / "tuned.so"
    rc, _, err = run_cli(capsys, "export", "--spec", SPEC_STR, "--logs", tuned_logs, "-o", lib)
    assert rc == 0, err
    assert "warning" not in err  # the only kernel is tuned
    m = swa_tvm.runtime.library.read_manifest(lib)
    (k,) = m["kernels"]
    assert k["tuned"] is True and k["tuning"]["records"] >= 4 and k["tuning"]["gflops"] > 0
    rc, out, _ = run_cli(capsys, "info", lib)
    assert rc == 0 and "tuned:" in out
    swa_tvm.load_library(lib)
    check_against_reference(*(torch.randn(2, 2, 333, 16) for _ in range(3)), window_size=(7, 0))


def test_records_never_cross_cpu_classes(tuned_logs, tmp_path):
    """Records live per class; even copied into another class's folder, a record whose
    own target is another CPU is not applied there."""
    import shutil

    here = host_target()
    other = dict(here, mcpu="skylake-avx512" if here["mcpu"] != "skylake-avx512" else "znver4")
    assert records.best_record(KSPEC, here, str(tuned_logs)) is not None
    assert records.best_record(KSPEC, other, str(tuned_logs)) is None  # no folder for it
    shutil.copytree(records.log_dir(str(tuned_logs), here), tmp_path / target_key(other))
    assert records.best_record(KSPEC, other, str(tmp_path)) is None  # folder, foreign records


def test_untuned_export_warns_naming_the_kernel(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "export", "--spec", "head_dim=16,window=2:2", "--logs", tmp_path, "-o", tmp_path / "x.so")
    assert rc == 0, err
    assert "warning: kernel swa_local_d16_f32_l2_r2_md1_x0_bq32: no tuning record" in err
    assert "default schedule" in out


def test_torn_last_line_is_skipped_other_damage_is_an_error(tuned_logs, tmp_path):
    import shutil

    folder = tmp_path / "f"
    shutil.copytree(records.log_dir(str(tuned_logs), host_target()), folder)
    rec = folder / records.RECORD_FILE
    lines = rec.read_text().splitlines()
    rec.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])
    with pytest.warns(UserWarning, match="torn last line"):
        assert len(records.open_log(str(folder), readonly=True)) == len(lines)
    rec.write_text(lines[0][:10] + "\n" + "\n".join(lines[1:]) + "\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        records.open_log(str(folder), readonly=True)


def test_a_lookup_decodes_only_the_workloads_it_wants(tmp_path):
    """A lookup (``only``: the workload keys wanted) reads the rest of the log by each
    line's first field alone: the same records as a full read for what it wants, and a
    damaged line of another workload does not stop it (a full read still refuses it)."""
    shipped = os.path.join(os.path.dirname(records.__file__), os.pardir, "tuning_logs", "llvm-znver4")
    wl = open(os.path.join(shipped, records.WORKLOAD_FILE)).read().splitlines()
    recs = [ln for ln in open(os.path.join(shipped, records.RECORD_FILE)).read().splitlines()
            if ln.startswith(("[11,", "[12,"))]  # the two small workloads: 4 records each
    folder = tmp_path / "log"
    folder.mkdir()
    (folder / records.WORKLOAD_FILE).write_text("\n".join(wl) + "\n")
    (folder / records.RECORD_FILE).write_text("\n".join(recs) + "\n")
    import json

    key11, key12 = json.loads(wl[11])[0], json.loads(wl[12])[0]
    full = records.open_log(str(folder), readonly=True)
    assert len(full) == 8 and len(full.get_all_tuning_records()) == 8
    one = records.open_log(str(folder), only={key11})
    assert len(one) == 8  # every record line counted, 4 decoded
    def times(run_secs):
        return [round(float(t), 9) for t in run_secs]

    got = sorted(times(r.as_json()[1]) for r in one.get_all_tuning_records())
    want = sorted(times(json.loads(ln)[1][1]) for ln in recs if ln.startswith("[11,"))
    assert len(got) == 4 and got == want  # the run times of workload 11's own records
    whole = recs[-1]
    recs[-1] = "[12, not json"
    (folder / records.RECORD_FILE).write_text("\n".join(recs + [whole]) + "\n")
    assert len(records.open_log(str(folder), only={key11}).get_all_tuning_records()) == 4
    with pytest.raises(ValueError, match="line 8 is not JSON"):
        records.open_log(str(folder), readonly=True)
    # A torn last line is skipped with a warning in a lookup as in a full read, even
    # one of a workload the lookup does not want.
    (folder / records.RECORD_FILE).write_text("\n".join(recs[:-1] + [whole, whole[: len(whole) // 2]]) + "\n")
    with pytest.warns(UserWarning, match="torn last line"):
        assert len(records.open_log(str(folder), only={key11})) == 8
    with pytest.warns(UserWarning, match="torn last line"):
        assert len(records.open_log(str(folder), readonly=True)) == 8
    assert key12 != key11


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_tracker_with_two_servers(tmp_path):
    """A short tune measured through TVM's RPC tracker on two local RPC servers."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                               "--port", str(port), "--port-end", str(port + 1)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]  # fmt: skip
    try:
        # The servers start beside the tracker (each process imports TVM first, ~9 s
        # here): a server retries the tracker's port every 5 s until it answers.
        for _ in range(2):
            sport = _free_port()
            procs.append(
                subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
                                  "--key", "swa-test", "--host", "127.0.0.1", "--port", str(sport), "--port-end", str(sport + 1)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert all(p.poll() is None for p in procs), "the RPC tracker or a server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        from tvm.s_tir.meta_schedule.runner import RPCConfig

        cfg = RPCConfig("127.0.0.1", port, "swa-test", session_timeout_sec=10)
        while cfg.count_num_servers() < 2 and time.time() < deadline:
            time.sleep(1)
        assert cfg.count_num_servers() == 2
        logs = tmp_path / "logs"
        r = subprocess.run(_tune_cmd(logs, tmp_path / "work", 2, 2, "--rpc-tracker", f"127.0.0.1:{port}",
                                     "--rpc-key", "swa-test"), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        folder = records.log_dir(str(logs), host_target())
        assert _check_logs_readable(folder) >= 2
        db = records.open_log(folder, readonly=True)
        secs = [float(s) for rec in db.get_all_tuning_records() for s in rec.run_secs]
        assert secs and all(0 < s < 1e9 for s in secs), secs  # measured, not failure markers
    finally:
        for p in procs:  # with their popen workers, which would outlive them
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_bad_tune_arguments(capsys):
    from swa_tvm import cli

    cases = [(["--trials", "0"], "trials must be >= 1"),
             (["--trials", "2", "--rpc-tracker", "nohost"], "HOST:PORT"),
             (["--trials", "2", "--rpc-tracker", "127.0.0.1:9190"], "rpc_key is required")]  # fmt: skip
    for extra, message in cases:
        rc, _, err = run_cli(capsys, "tune", "--spec", SPEC_STR, *extra)
        assert rc == 1 and message in err
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--rpc-tracker" in out and "--work-dir" in out


def test_backward_kernels_tune_and_export_with_their_own_records(tmp_path, fresh_registry, capsys):
    """`tune --kernels backward` tunes only the gradient kernels of a spec, each under its
    own workload; export applies those records and the gradients stay exact."""
    spec = "head_dim=16,window=7:0,backward"
    rc, _, err = run_cli(capsys, "tune", "--spec", "head_dim=16,window=7:0", "--kernels", "backward", "--trials", "1",
                      "--logs", tmp_path / "logs")  # fmt: skip
    assert rc == 1 and "add ',backward'" in err
    r = subprocess.run(CLI + ["tune", "--spec", spec, "--kernels", "backward", "--trials", "2", "--trials-per-iter", "2",
                              "--logs", str(tmp_path / "logs"), "--work-dir", str(tmp_path / "work"), "--seed", "0",
                              "--quiet"], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    kernels = AttentionSpec.parse(spec).kernels()
    found = {k.kind: records.best_record(k, host_target(), str(tmp_path / "logs")) for k in kernels}
    assert found["local"] is None and found["local_dq"] is not None and found["local_dkv"] is not None
    # The search started from the default schedule: its point was measured and logged,
    # so the best record is never one the default beats at the tuning shape.
    from swa_tvm.compiler.targets import _vector_lanes

    import tvm

    db = records.open_log(records.log_dir(str(tmp_path / "logs"), host_target()), readonly=True)
    lanes = _vector_lanes(tvm.target.Target(host_target()))
    for k in kernels[1:]:
        if k.kind == "local_bwd":  # hand-written: no search space, nothing tuned
            continue
        default = str(records.default_point(k, lanes).trace)
        recs = db.records_for(records.tuning_workload(k))
        assert any(str(r.trace) == default for r in recs), k.name
    lib = tmp_path / "train.so"
    rc, _, err = run_cli(capsys, "export", "--spec", spec, "--logs", tmp_path / "logs", "-o", lib)
    assert rc == 0, err
    tuned = {k["spec"]["kind"]: k["tuned"] for k in swa_tvm.runtime.library.read_manifest(lib)["kernels"]}
    # The five-product backward is hand-written: exported, never tuned.
    assert tuned == {"local": False, "local_dq": True, "local_dkv": True, "local_bwd": False}
    swa_tvm.load_library(lib)
    q, kk, v = (torch.randn(1, 2, 150, 16, requires_grad=True) for _ in range(3))
    out = swa_tvm.sliding_window_attention(q, kk, v, window_size=(7, 0))
    ref, _ = sliding_window_attention_ref(q, kk, v, window_size=(7, 0))
    d = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, kk, v), d)
    want = torch.autograd.grad(ref, (q, kk, v), d.double())
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


def test_tuning_shape_covers_long_windows():
    """Windows reaching past T/2 are tuned at a T where most rows see the whole window;
    the shipped CPU spec sets keep T=2048, so their committed records still match."""
    from benchmarks import forward as bench
    from benchmarks import training as bench_train

    def T_of(text):
        return {k.kind: records.tune_shapes(k)["T"] for k in AttentionSpec.parse(text).kernels()}

    assert T_of("head_dim=128,window=4095:0,globals,dtype=bfloat16") == {"local": 8192, "global": 2048}
    assert T_of("head_dim=64,window=1023:0,dilation=2")["local"] == 4096  # reach 2047 positions
    assert T_of("head_dim=64,window=1024:1024")["local"] == 6144
    assert T_of("head_dim=64,window=-1:0")["local"] == 2048  # unbounded: the default
    shipped = bench.spec_strings() + bench_train.spec_strings()
    assert {T for text in shipped for T in T_of(text).values()} == {2048}


def test_tuning_inputs_are_in_range_and_distinct():
    """MetaSchedule's runner fills a kernel's tables as the GPU batch runner does:
    dilation 1, global/extra positions distinct, sorted and below T (not q_global's G)."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    for k in AttentionSpec.parse("head_dim=16,window=7:0,globals,backward").kernels():
        if k.kind in CPU_ONLY_KINDS:  # hand-written: not tuned
            continue
        info = [a.as_json() for a in ArgInfo.from_prim_func(records.tuning_workload(k)["main"])]
        T = records.tune_shapes(k)["T"]
        for (_, dtype, shape), x in zip(info, tune.tuning_inputs(info)):
            assert x.dtype == dtype and list(x.shape) == list(shape)
            if dtype == "int32" and x.ndim == 1:
                assert (x == 1).all()  # dilation
            elif dtype == "int32":
                assert (x >= 0).all() and (x < T).all() and (np.diff(x, axis=1) > 0).all(), k.kind
                assert x.max() > T // 2, "positions spread over the sequence"


@pytest.mark.parametrize("block,seed", [(4, 1), (16, 2)])
def test_sampled_cache_schedules_replay_and_are_correct(block, seed, monkeypatch):
    """A random point of a KV-cache kernel's search space (a decode block of 4 rows, and
    a block of 16), sampled at the tuning shape and replayed on the symbolic kernel,
    serves attention_with_kv_cache at other shapes: the full call's rows."""
    import tvm
    from tvm import s_tir

    from swa_tvm import eager
    from swa_tvm.compiler.targets import _vector_lanes
    from swa_tvm.runtime.library import Kernel
    from swa_tvm.schedules import cpu

    spec = KernelSpec("cache", 16, "float32", 7, 0, 2, extras=True, block_q=block, softcap=True)
    sch = s_tir.Schedule(records.tuning_workload(spec), seed=seed)
    cpu.schedule(sch, spec, _vector_lanes(tvm.target.Target(host_target())), cpu.Sampled())
    assert any(i.kind.name in ("SamplePerfectTile", "SampleCategorical") for i in sch.trace.insts)
    f = _compile_one(records.apply_record(spec, sch.trace))[spec.name]
    served = []
    original = eager._kernel

    def sampled(want, device):
        if want.name == spec.name:
            served.append(want.name)
            return Kernel(want, f, device, "sampled")
        return original(want, device)

    monkeypatch.setattr(eager, "_kernel", sampled)
    H, Hkv, D, N = 4, 2, 16, 40
    Tq = 2 if block == 4 else 7  # rows = Tq x 2 heads a group: 4, or 14 of a 16-row block
    q, k, v = torch.randn(2, H, N, D), torch.randn(2, Hkv, N, D), torch.randn(2, Hkv, N, D)
    kw = dict(window_size=(7, 0), dilation=torch.tensor([1, 2, 1, 2]), num_sinks=3, softcap=2.5)
    out, lse = swa_tvm.attention_with_kv_cache(q[:, :, 30 : 30 + Tq], k[:, :, : 30 + Tq], v[:, :, : 30 + Tq],
                                               q_offset=30, return_lse=True, **kw)
    assert served
    ref, ref_lse = sliding_window_attention_ref(q, k, v, **kw)
    assert rel_err(out, ref[:, :, 30 : 30 + Tq]) < 1e-5 and rel_err(lse, ref_lse[:, :, 30 : 30 + Tq]) < 1e-5


def test_cache_kernels_tune_and_export_with_their_records(tmp_path, fresh_registry):
    """`tune` with `kvcache` in a spec tunes the KV-cache kernels at their decode shape;
    export applies the records, and the library serves decode steps exactly."""
    spec = "head_dim=16,window=7:0,sinks,kvcache,softcap"
    r = subprocess.run(CLI + ["tune", "--spec", spec, "--kernels", "forward", "--trials", "2", "--trials-per-iter", "2",
                              "--logs", str(tmp_path / "logs"), "--work-dir", str(tmp_path / "work"), "--seed", "0",
                              "--quiet"], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    cache = [k for k in AttentionSpec.parse(spec).kernels() if k.kind == "cache"]
    assert all(records.best_record(k, host_target(), str(tmp_path / "logs")) is not None for k in cache)
    lib = tmp_path / "kv.so"
    swa_tvm.export_library([AttentionSpec.parse(spec)], lib, logs=str(tmp_path / "logs"))
    tuned = {k["spec"]["block_q"]: k["tuned"] for k in swa_tvm.runtime.library.read_manifest(lib)["kernels"]
             if k["spec"]["kind"] == "cache"}
    assert tuned == {4: True, 8: True, 16: True}
    swa_tvm.load_library(lib)
    q, k, v = torch.randn(2, 4, 30, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    kw = dict(window_size=(7, 0), num_sinks=2, softcap=3.0)
    ref, _ = sliding_window_attention_ref(q, k, v, **kw)
    for q0 in (29, 20):  # a decode step (block of 4 rows) and a chunk of 10 queries (16)
        out = swa_tvm.attention_with_kv_cache(q[:, :, q0:], k, v, **kw)
        assert rel_err(out, ref[:, :, q0:]) < 1e-5
