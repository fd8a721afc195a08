# One-command entry points. `make demo` and `make test` each run `make setup` first,
# so either works alone on a fresh clone with Python 3.11 and the package registries.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
# NeMo 3.x pins lightning 2.4, the main environment has a newer one: NeMo gets its own.
NEMO_VENV  := .venv-nemo
NEMO_PY    := $(NEMO_VENV)/bin/python
NEMO_STAMP := $(NEMO_VENV)/.setup-stamp
# The CPU wheel of torch; a newer or unpinned torch would pull a multi-GB CUDA build.
# GPU users: see docs/guide/install.md ("Installing on GPU hosts").
TORCH_SPEC ?= torch==2.13.0
# `.ci/run` sets SUITE_BUDGET=--warn-over=720 (12 min; 1800 under --load): a warning past it.
SUITE_BUDGET ?=
# The compatibility leg (`make test-compat`): the newest torch on Python 3.12, in its own
# environment. The registry's wheel is a CUDA build that runs on the CPU (about 3 GB with
# its CUDA libraries; pip's cache keeps it between runs on one machine). A pip capped
# below it (/etc/xdg/pip on these CI hosts) refuses it: `.ci/run` lifts the cap first.
COMPAT_VENV   := .venv-compat
COMPAT_PY     := $(COMPAT_VENV)/bin/python
COMPAT_STAMP  := $(COMPAT_VENV)/.setup-stamp
COMPAT_TORCH  ?= 2.15.0
# The first Python 3.12 that runs (a pyenv shim may exist and refuse to).
COMPAT_PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python; do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo $$p; break; }; done)

.PHONY: setup setup-nemo setup-compat bytecode demo docs test test-compat test-nemo test-fast test-slow bench lint clean test-gpu

setup: $(STAMP)
	@test -x /usr/bin/etcd || echo "hint: /usr/bin/etcd is missing, so the etcd tests (tests/test_etcd_*.py, the etcd partition test) will skip (apt-get install etcd-server)"
	@test -x /usr/sbin/slurmd || echo "hint: Slurm is missing, so tests/test_slurm.py will skip (apt-get install slurm-wlm munge)"

$(STAMP): pyproject.toml Makefile replication/snapshots/_streamcopy.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup-nemo: $(NEMO_STAMP)

$(NEMO_STAMP): pyproject.toml Makefile replication/snapshots/_streamcopy.c
	test -x $(NEMO_PY) || $(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_PY) -m pip install -q --upgrade pip
	$(NEMO_PY) -m pip install -q "$(TORCH_SPEC)"
	$(NEMO_PY) -m pip install -q -e ".[nemo]" "pytest>=8" "pytest-timeout>=2.3"
	touch $(NEMO_STAMP)

setup-compat: $(COMPAT_STAMP)

# torch first, then the project, which must leave it alone (the range admits it): the
# version is checked after both.
$(COMPAT_STAMP): pyproject.toml Makefile replication/snapshots/_streamcopy.c
	@test -n "$(COMPAT_PYTHON)" || { echo "make test-compat: no Python 3.12 found (set COMPAT_PYTHON=/path/to/python3.12)" >&2; exit 1; }
	test -x $(COMPAT_PY) || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q "torch==$(COMPAT_TORCH)"
	$(COMPAT_PY) -m pip install -q -e ".[dev]"
	$(COMPAT_PY) -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(COMPAT_TORCH)' else f'installing the project changed torch to {v}')"
	touch $(COMPAT_STAMP)

demo: setup
	$(PY) -m examples.demo

# pytest writes its JUnit report only when the session ends; a missing report means the
# run died part-way (say, something called os._exit) even if the exit status was 0.
# Three xdist workers, one test file each at a time (--dist loadfile), on a 2-core CI
# host: since workers are forked from the zygote (ADR 0029) a job costs a third of the
# CPU it did, and with two workers the cores sat idle 28 % of the run while tests waited
# on heartbeat and join timeouts. Budget 12 minutes (docs/testing.md); every test
# tolerates the other files' load.
# The user guide: a static site in build/docs, every warning an error (a broken link
# between pages, a page in no table of contents).
docs: setup
	$(PY) -m sphinx -W --keep-going -n -q -b html docs build/docs

test: setup setup-nemo
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory bytecode
	rm -f build/pytest-main.xml build/pytest-nemo.xml
	$(PY) -m pytest -q -n 3 --dist loadfile --junitxml=build/pytest-main.xml
	test -s build/pytest-main.xml || { echo "pytest ended without finishing the session" >&2; exit 1; }
	$(PY) .ci/suite_time.py build/pytest-main.xml $(SUITE_BUDGET)
	$(NEMO_PY) -m pytest -q tests/nemo_toolkit --junitxml=build/pytest-nemo.xml
	test -s build/pytest-nemo.xml || { echo "pytest ended without finishing the session" >&2; exit 1; }

# The suite starts thousands of interpreters, each importing this repository. Where the
# environment sets PYTHONDONTWRITEBYTECODE (as some CI images do) every one of them
# compiled every module again; compiled once here, they only read the bytecode.
bytecode:
	$(PY) -m compileall -q -j 0 recovery replication launcher dataloader_cache benchmarks examples tests >/dev/null

# The compatibility leg: the tests marked `compat` (tests/conftest.py: a file per
# capability) and the demo's job, bit-identical, on the newest torch and Python 3.12.
test-compat: setup-compat
	$(COMPAT_PY) -c "import sys, torch; print(f'compatibility leg: torch {torch.__version__}, Python {sys.version.split()[0]}')"
	rm -f build/pytest-compat.xml
	$(COMPAT_PY) -m pytest -q -n 3 --dist loadfile -m compat --junitxml=build/pytest-compat.xml
	test -s build/pytest-compat.xml || { echo "pytest ended without finishing the session" >&2; exit 1; }
	$(COMPAT_PY) -m examples.demo

# The whole suite beside a steady competing load (.ci/load.py: one CPU-bound process per
# core and a disk writer), as on a cluster node that is not idle. Budget 30 minutes.
test-load: setup setup-nemo
	$(PY) .ci/load.py -- $(MAKE) --no-print-directory test SUITE_BUDGET="$(SUITE_BUDGET)"

test-nemo: setup-nemo
	$(NEMO_PY) -m pytest -q tests/nemo_toolkit

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) -m benchmarks.run_all

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(NEMO_VENV) $(COMPAT_VENV) build *.egg-info .pytest_cache

# The GPU check (docs/gpu.md) on the device machine's own python3, not the CPU venv: the
# C extension is built for that interpreter (optional: without it snapshots copy with
# torch), then every check runs in its own process under its own timeout, 8 minutes in all.
test-gpu:
	-PYTHONPATH=. python3 -c "from setuptools import setup, Extension; setup(script_args=['build_ext','--inplace','-q'], ext_modules=[Extension('replication.snapshots._streamcopy', ['replication/snapshots/_streamcopy.c'], extra_compile_args=['-O2'])])" || echo "streamcopy extension not built: snapshots fall back to torch copies"
	PYTHONPATH=. timeout 500 python3 tests/gpu/run_gpu_check.py --budget-s 470
