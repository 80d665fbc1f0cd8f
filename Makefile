# Everything installs from scratch into .venv. torch is installed first and pinned:
# that CPU wheel lies on this machine's disk, while an open range pulls a CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: venv test check demo bench report tune gpu-bundle clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[test,bench,sass,transformers]'
	touch $(STAMP)

# One pytest worker per core (at most 8), tests sharing a module fixture on one worker
# (tests/conftest.py); WORKERS=0 runs them in this process.
WORKERS ?= auto
PYTEST  = SWA_TVM_CACHE=$${SWA_TVM_CACHE:-$(CURDIR)/.venv/swa_cache} $(VPY) -m pytest -q tests -n $(WORKERS) --maxprocesses 8 --dist loadgroup

# The full suite (CI runs it).
test: $(STAMP)
	$(PYTEST)

# The quick tier (under 3 minutes on 2 cores): the API and its checks, specs, semantics
# against the float64 reference on small shapes, the library round trip. Everything
# marked slow (tuning, CUDA codegen, subprocess suites) is left to `make test`.
check: $(STAMP)
	$(PYTEST) -m "not slow"

demo: $(STAMP)
	$(VPY) examples/demo.py

# The full benchmark (tens of minutes on 2 cores) into benchmarks/results/<target-key>/:
# results.json and scaling.png, then forward + backward against the peers that train:
# training.json. `make report` turns every results folder into docs/performance.md.
bench: $(STAMP)
	$(VPY) -m benchmarks.forward
	$(VPY) -m benchmarks.training

report: $(STAMP)
	$(VPY) -m benchmarks.report --out docs/performance.md

# Tune the shipped spec set (swa_tvm/tuning_logs/shipped_specs.txt) for this CPU class
# into swa_tvm/tuning_logs/<target-key>/ (continues from what is there).
TRIALS  ?= 64
SHIPPED := swa_tvm/tuning_logs/shipped_specs.txt
tune: $(STAMP)
	$(VENV)/bin/swa-tvm tune --trials $(TRIALS) $$(grep -v '^#' $(SHIPPED) | sed 's/^/--spec /')

# CUDA libraries, the TVM runtime and the tvm-ffi wheel for tools/gpu_decide.sh and
# tools/gpu_check.sh on a GPU machine without TVM (needs nvcc, not a GPU): build/gpu/,
# what the decision run needs (GPU_BUNDLE_FLAGS: --gradients, --kv-cache,
# --tune-trials N for more). This checkout's swa_tvm, whatever the editable install
# points at.
CUDA_ARCH ?= sm_90
GPU_BUNDLE_FLAGS ?=
gpu-bundle: $(STAMP)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(VPY) -m tools.gpu_bundle --arch $(CUDA_ARCH) $(GPU_BUNDLE_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info demo_out
