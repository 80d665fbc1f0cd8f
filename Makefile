# Everything installs from scratch into .venv. torch is installed first and pinned:
# that CPU wheel lies on this machine's disk, while an open range pulls a CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: venv test demo bench tune clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[test,bench]'
	touch $(STAMP)

test: $(STAMP)
	SWA_TVM_CACHE=$${SWA_TVM_CACHE:-$(CURDIR)/.venv/swa_cache} $(VPY) -m pytest -q tests

demo: $(STAMP)
	$(VPY) examples/demo.py

# The full benchmark (tens of minutes on 2 cores): bench/results.json, bench/scaling.png.
bench: $(STAMP)
	$(VPY) examples/benchmark.py

# Tune the shipped spec set for this CPU class into tuning_logs/ (continues from what is there).
TRIALS ?= 64
tune: $(STAMP)
	$(VENV)/bin/swa-tvm tune --trials $(TRIALS) $$($(VPY) -c "from swa_tvm.bench import spec_strings; print(' '.join('--spec ' + s for s in spec_strings()))")

clean:
	rm -rf $(VENV) build *.egg-info demo_out
