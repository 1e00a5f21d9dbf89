# `make demo` and `make test` set up their own virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# `make bench` compares jdist with its peers, which get a venv of their own and
# never become jdist's dependencies. torch==2.13.0 is the CPU build on this
# disk (plain `torch` would fetch a CUDA build of several GB): it is installed
# with accelerate so that accelerate cannot pull another torch. Each group
# installs on its own; one that fails is left out of RESULTS.md with the reason.
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_GROUPS := "torch==2.13.0 accelerate==1.15.0" "jax==0.10.2 jaxlib==0.10.2 keras==3.15.1" \
	"tensorflow-cpu==2.21.0"
PEERS_STAMP := $(PEERS_VENV)/.installed-$(shell echo '$(PEERS_GROUPS)' | cksum | cut -d' ' -f1)
BENCH_ARGS ?=
# benchmarks/mixed_precision.py compiles for a TPU without one (deviceless
# AOT): libtpu goes into a directory of its own, on PYTHONPATH for that script
# only, so that jdist's venv never tries to start a TPU runtime.
TPU_PLUGIN ?= .tpu-plugin
LIBTPU := libtpu==0.0.42.1

.PHONY: demo test docs bench dist clean

# The venv's packages go in with uv (from the registry, like pip): on this
# 2-core machine it sets up the venv in ~60 s where pip takes ~100 s. It
# compiles the bytecode as pip does (imports stay fast where Python may not
# write it). Where uv cannot be had, pip does the same install.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	($(PY) -m pip install --quiet uv && \
	  $(PY) -m uv pip install --python $(PY) --quiet --compile-bytecode \
	    -e ".[test,examples]") || \
	  $(PY) -m pip install --quiet -e ".[test,examples]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --quiet --upgrade pip
	for group in $(PEERS_GROUPS); do \
	  $(PEERS_PY) -m pip install --quiet $$group || \
	    echo "make bench: '$$group' did not install; those peers will be left out"; \
	done
	rm -f $(PEERS_VENV)/.installed-*
	touch $(PEERS_STAMP)

$(TPU_PLUGIN)/.installed-$(LIBTPU):
	rm -rf $(TPU_PLUGIN)
	$(PY) -m pip install --quiet --target $(TPU_PLUGIN) $(LIBTPU) && \
	  touch "$(TPU_PLUGIN)/.installed-$(LIBTPU)" || \
	  echo "make bench: $(LIBTPU) did not install; the TPU memory rows will be left out"

demo: $(STAMP)
	$(PY) -m jdist.examples.demo

# Three pytest workers, one test file each at a time (module fixtures, such
# as a Ray cluster, stay in one process): much of the suite waits on processes
# it started or on leases and timeouts, so on two cores a third worker fills
# the time two leave idle. Files go out in collection order, heaviest first
# (tests/conftest.py), so that the workers end together. TEST_WORKERS=0 runs
# it in this process.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# The documentation site in docs/_build/html, warnings as errors. The
# notebooks are executed (myst-nb keeps their outputs in a cache under
# docs/_build: a notebook runs again only when it changed); the suite's build
# (tests/test_docs.py) does not execute them, since tests/test_notebooks.py
# runs them already. DOCS_ARGS=-E rebuilds every page.
DOCS_ARGS ?=
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -b html $(DOCS_ARGS) docs docs/_build/html

# An sdist and a wheel in dist/ (the wheel is what a Colab notebook installs).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

bench: $(STAMP) $(PEERS_STAMP) $(TPU_PLUGIN)/.installed-$(LIBTPU)
	$(PY) benchmarks/run.py --peers-python $(PEERS_PY) --tpu-plugin $(TPU_PLUGIN) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(TPU_PLUGIN) .pytest_cache dist build *.egg-info docs/_build
