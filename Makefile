# Two commands do everything on a fresh machine with Python 3.9+ and a C++ compiler:
#   make demo    set up .venv (torch==2.13.0 unless the venv has a torch), build, run the demo
#                (a worker SIGKILLed mid-step under fastdist run and replaced)
#   make test    same set-up, then `make check` (lint, types, sanitizers), then the test suite less
#                the framework and multi-node jobs (make test-jobs runs those; .ci/run runs both)
#   make bench   same set-up, then bench/ (results in bench/results/)
#   make docs    same set-up, then the documentation site (docs/) into build/site
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fastdist-installed
SOURCES := pyproject.toml CMakeLists.txt $(shell find csrc python -type f -not -name '*.pyc' 2>/dev/null)

.PHONY: setup demo check test test-jobs bench docs clean bench-smoke

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# fastdist._watched is compiled against the installed torch: build without isolation.
	$(PY) -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12"
	# The test extra installs packages that depend on torch (Lightning, Accelerate): pinned to
	# the torch already here, so that pip never swaps it for another build.
	$(PY) -m pip install -q --no-build-isolation ".[test,bench,lint,docs]" \
	  "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	touch $@

demo: setup
	$(PY) -m fastdist demo --kill

# The gates: ruff (lint and format), mypy --strict, and the engine's stress test under
# ThreadSanitizer and ASan + UBSan. Any finding fails the build.
check: setup
	$(VENV)/bin/ruff check python tests bench
	$(VENV)/bin/ruff format --check python tests bench
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site
	scripts/sanitize

# The documentation site (docs/, mkdocs.yml) into build/site: open build/site/index.html.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

# Three workers on 2 cores: much of the suite's time is spent waiting for deadlines and processes
# (fresh clone with a busy loop holding one core beside it: 11 min 59 s in all, the suite 515 s; four
# workers were slower there, 13 min 31 s, and three timing tests failed).
# The tests' CPU double of NCCL (tests/support/doubles, torch's cpp_extension) is built against this torch
# while the gates run (about a minute of compiling, beside mypy's one core).
test: setup
	scripts/install-test-deps
	$(PY) -c "import sys; sys.path.insert(0, 'tests/support'); import fake_nccl" & double=$$!; \
	  $(MAKE) --no-print-directory check; gates=$$?; wait $$double || exit 1; exit $$gates
	$(PY) -m pytest -n 3 --dist worksteal --durations=25 -m "not bench_smoke and not frameworks and not nodes"

# The tests that start a framework (Lightning, Fabric, Accelerate, the Hugging Face Trainer) or
# torch's own distributed suite, and the jobs of several nodes (marked in tests/conftest.py): a
# step of their own, which .ci/run runs after make test on every submission (about 5 minutes).
test-jobs: setup
	scripts/install-test-deps
	$(PY) -m pytest -n 3 --dist worksteal --durations=10 -m "frameworks or nodes"

# bench/ must not rot: each benchmark once, tiny, no timing asserted (about a minute; .ci/run runs
# it after make test, which it would push past 15 minutes on 2 cores).
bench-smoke: setup
	scripts/install-test-deps
	$(PY) -c "import sys; sys.path.insert(0, 'tests/support'); import fake_nccl"
	$(PY) -m pytest -n 2 --dist worksteal -m bench_smoke

# The benchmarks (about 9 minutes on 2 cores): JSON, a markdown summary and a PNG plot in bench/results/.
bench: setup
	scripts/install-test-deps
	mkdir -p bench/results
	$(PY) -m pytest bench -q -s -o addopts="" --benchmark-json=bench/results/latest.json
	$(PY) bench/report.py bench/results/latest.json

clean:
	rm -rf build $(VENV)
