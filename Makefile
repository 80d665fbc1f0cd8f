# Everything installs from scratch into .venv. torch is installed first and pinned:
# that CPU wheel lies on this machine's disk, while an open range pulls a CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: venv test demo bench tune gpu-bundle clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[test,bench,sass]'
	touch $(STAMP)

# One pytest worker per core (at most 8), tests sharing a module fixture on one worker
# (tests/conftest.py); WORKERS=0 runs them in this process.
WORKERS ?= auto
test: $(STAMP)
	SWA_TVM_CACHE=$${SWA_TVM_CACHE:-$(CURDIR)/.venv/swa_cache} $(VPY) -m pytest -q tests -n $(WORKERS) --maxprocesses 8 --dist loadgroup

demo: $(STAMP)
	$(VPY) examples/demo.py

# The full benchmark (tens of minutes on 2 cores): bench/results.json, bench/scaling.png,
# then forward + backward against the peers that train: bench/training.json.
bench: $(STAMP)
	$(VPY) examples/benchmark.py
	$(VPY) examples/benchmark.py --training

# Tune the shipped spec set (the benchmark's forward kernels and the training benchmark's
# backward kernels) for this CPU class into tuning_logs/ (continues from what is there).
TRIALS ?= 64
SPECS_PY := from swa_tvm import bench, bench_train; print(' '.join('--spec ' + s for s in bench.spec_strings() + bench_train.spec_strings()))
tune: $(STAMP)
	$(VENV)/bin/swa-tvm tune --trials $(TRIALS) $$($(VPY) -c "$(SPECS_PY)")

# CUDA libraries, the TVM runtime and the tvm-ffi wheel for examples/gpu_check.sh on a
# GPU machine without TVM (needs nvcc, not a GPU): build/gpu/.
CUDA_ARCH ?= sm_90
gpu-bundle: $(STAMP)
	$(VPY) -m swa_tvm.gpu_bundle --arch $(CUDA_ARCH)

clean:
	rm -rf $(VENV) build *.egg-info demo_out
