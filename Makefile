# kvcd developer targets. Every target sets the machine up first (scripts/setup.sh, idempotent).
#   make check       what CI runs: lint, types, layer contracts, unit + integration tests, the
#                    unit tests again on Python 3.9 (the oldest supported), VM e2e
#   make demo        boot the VM guest, start kvcd@e2e-kmod; one screen: systemctl status, lsmod,
#                    kvcd status, its journal (build output folded); full logs in out/e2e/demo
#   make test        unit, docs (what README/packaging tell users to paste, through kvcd's code)
#                    and integration tests (real podman, gcc, depmod, rpmbuild on this machine)
#   make test-oldest the unit and docs tests on Python 3.9 (.venv-oldest)
#   make lint        ruff, mypy --strict, import-linter
#   make rpm         build the RPMs into out/rpm and rpmlint them
#   make bench       the host benchmarks (quick runs): one table of figures, goals, ratios to peers
#   make e2e         build/reuse the guest; every guest step (core, every scenario file, reboot),
#                    in two guests side by side
#   make e2e-full    the same steps in one guest, in order
#   make e2e-smoke   the same, harness checks only (no kvcd needed)
#   make e2e-guest   only build (or reuse) the cached guest image
#   make e2e-harness the VM harness's own tests, no VM (entry.sh steps + reboots with fakes)
#   make e2e-clean   drop the cached guest and the run outputs
# The VM end-to-end harness lives in scripts/e2e and tests/e2e.

VENV := .venv/bin
# Not $(shell …): that would be read before `setup` has made the venv on a fresh machine.
PYTHON ?= $(VENV)/python
E2E_CACHE ?= $(or $(KVCD_E2E_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvcd-e2e)
PY_DIRS := kvcd tests benchmarks

.PHONY: setup check lint test test-oldest bench bench-guest rpm e2e e2e-full e2e-harness e2e-smoke e2e-guest demo e2e-clean

setup:
	scripts/setup.sh

# Each step's wall time goes to out/steps.txt and is printed at the end (and on a failure).
STEP := scripts/step.sh
check:
	@rm -f out/steps.txt
	@$(STEP) setup scripts/setup.sh
	@$(STEP) lint $(MAKE) --no-print-directory lint
	@$(STEP) test $(MAKE) --no-print-directory test
	@$(STEP) test-oldest $(MAKE) --no-print-directory test-oldest
	@$(STEP) e2e $(MAKE) --no-print-directory e2e
	@$(STEP) --report

lint: setup
	$(VENV)/ruff check $(PY_DIRS)
	$(VENV)/ruff format --check $(PY_DIRS)
	$(VENV)/mypy
	$(VENV)/lint-imports

# pytest exits 5 when it collected nothing; make treats that as the failure it is.
# Two processes (pytest-xdist), a test file each at a time: the tests mostly wait (on podman, on a
# daemon they started), so a second process nearly halves the wall time on a 2-core machine.
# TEST_JOBS=0 runs them in this one process.
TEST_JOBS ?= 2
PYTEST_JOBS = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
test: setup
	$(PYTHON) -m pytest $(PYTEST_JOBS) tests/unit tests/docs tests/integration

# The unit and docs tests again on the oldest Python kvcd supports (3.9, RHEL 9's): a 3.10+
# idiom in kvcd fails here, not on a node. Run from the tree (kvcd is not installed there).
test-oldest: setup
	.venv-oldest/bin/python -m pytest $(PYTEST_JOBS) -q -p no:cacheprovider tests/unit tests/docs

# The host benchmarks, quick runs, one table (out/bench/figures.md); BENCH_ARGS=--full for the
# long runs. The guest's figures: results/perf-table.md of `make e2e` (scenarios_perf).
bench: setup
	$(PYTHON) -m benchmarks $(BENCH_ARGS)

# The guest benchmarks (tests/e2e/guest/bench_*.py), in one TCG guest: twenty instances started
# at once (bench_fleet, ~15-25 min), or kvcd beside KVC's own unit (bench_kvc, ~15 min; needs
# KVC_UPSTREAM=DIR, a checkout of github.com/kmods-via-containers/kmods-via-containers). Tables
# in out/e2e/e2e/results/ (fleet-table.md, kvc-table.md, timings.txt).
BENCH_GUEST ?= bench_fleet
bench-guest: setup
	KVCD_E2E_ONLY="$(BENCH_GUEST)" KVCD_KVC_UPSTREAM="$(KVC_UPSTREAM)" \
		scripts/e2e/run-guest.sh --mode e2e

rpm: setup
	scripts/build-rpm.sh --lint

# The harness's own tests first (no VM, ~30 s): entry.sh's steps and reboots with fakes.
# Then every guest step, in two TCG guests booted side by side (one vCPU each: the 2-core CI
# machine runs both at once): the core step (smoke, the lifecycle scenarios, kvcd installed from
# the RPM payload, the KVC shim), every scenario file and the kernel update with a reboot. A
# scenario file that is in neither group fails the run (tests/e2e/test_vm.py), so a new one
# cannot be left out of CI by accident.
# The groups are balanced by the steps' measured times in CI (about 33 minutes each on a 2-core
# machine, TCG). reboot_nextkernel leaves its guest on the second kernel, so it does not share a
# guest with the reset and signing reboots. The guest without core builds e2e-kmod from the
# host's prebuilt modules (tests/e2e/guest/install.sh).
# faulthandler_timeout=0: the guest boot is one long fixture, bounded by qemu's own timeout.
E2E_SHARDS ?= core scenarios_devices scenarios_drift scenarios_faults scenarios_firmware scenarios_systemd scenarios_systemtree reboot_nextkernel | scenarios_gate scenarios_node scenarios_perf scenarios_purge scenarios_registry scenarios_restart scenarios_rpm_erase reboot_reset reboot_signing
e2e: setup e2e-harness
	KVCD_E2E_MODE=e2e KVCD_E2E_SHARDS="$(E2E_SHARDS)" $(PYTHON) -m pytest -o faulthandler_timeout=0 -m e2e tests/e2e

# Every step in one guest, in entry.sh's order (slower; for debugging an interaction).
e2e-full: setup e2e-harness
	KVCD_E2E_MODE=e2e KVCD_E2E_ONLY= KVCD_E2E_SHARDS= $(PYTHON) -m pytest -o faulthandler_timeout=0 -m e2e tests/e2e

e2e-harness: setup
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/e2e/test_harness.py

e2e-smoke: setup
	KVCD_E2E_MODE=smoke $(PYTHON) -m pytest -m e2e tests/e2e

e2e-guest: setup
	scripts/e2e/build-guest.sh

demo: setup
	scripts/e2e/run-guest.sh --mode demo

e2e-clean:
	rm -rf out/e2e "$(E2E_CACHE)"
