# Everything installs from scratch into .venv. torch is installed first and pinned:
# that CPU wheel lies on this machine's disk, while an open range pulls a CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	SWA_TVM_CACHE=$${SWA_TVM_CACHE:-$(CURDIR)/.venv/swa_cache} $(VPY) -m pytest -q tests

demo: $(STAMP)
	$(VPY) examples/demo.py

clean:
	rm -rf $(VENV) build *.egg-info demo_out
