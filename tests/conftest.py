import pytest

from helpers import Layouts, prepare_bytes

# The test modules whose `runs` fixture is a suite of tests/layouts_worker.py
LAYOUT_SUITES = {"test_parity": "dp", "test_tp": "tp", "test_pipeline": "pipeline", "test_context": "cp",
                 "test_moe": "ep", "test_composition": "matrix", "test_llama": "llama", "test_offload": "offload",
                 "test_lean": "lean"}
# The modules of a minute or more, longest first (their order on `make test`'s 2-core machine, alone):
# they start beside the layouts launch, so that no worker waits for it, and no long one is left for
# the end, where the other worker would idle beside it.
LONG = ["test_plan", "test_readme", "test_bench", "test_engine", "test_cli", "test_inputs", "test_checkpoint",
        "test_fp8", "test_preempt"]
# Run once the launch is over, most likely (after LONG and the launch's readers), longest first: they
# time heartbeats, detection and rendezvous in seconds (the fault, live and launcher tests of issue #55;
# beside the launch's 8 ranks on 2 cores, multi-rank gloo jobs ran 2-10x slower in some runs and not in
# others, and a live test's joiner missed its 3 s heartbeat there).
QUIET = ["test_fault", "test_live", "test_runtime", "test_scripts"]
LAUNCH = pytest.StashKey[Layouts]()


def suite_of(item):
    suite = LAYOUT_SUITES.get(item.module.__name__)
    return suite if suite and "runs" in item.fixturenames else None


def phase(item) -> tuple:
    """LONG's modules (in its order), the modules that read the layouts launch, QUIET's, then the
    rest: short modules, which keep both workers busy to the end."""
    name = item.module.__name__
    if name in LONG:
        return 0, LONG.index(name)
    return (1, 0) if name in LAYOUT_SUITES else (2, QUIET.index(name)) if name in QUIET else (3, 0)


@pytest.hookimpl(trylast=True)  # (after -k and the like have deselected)
def pytest_collection_modifyitems(session, config, items):
    """Modules in phase's order, otherwise in collection order; within a module, the tests that read
    the layouts launch after the others (the launch, one 8-rank process group, ~3 minutes of the
    2-core machine, works beside them)."""
    items.sort(key=lambda it: (phase(it), 1 if suite_of(it) else 0))


def pytest_configure(config):
    """pytest-xdist's --dist loadfile hands the workers whole modules in collection order (the order
    above), not its default of the modules with the most tests first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Start the layouts launch for every suite this session's tests ask for, before the first test.
    Under pytest-xdist (`make test` runs 2 workers) the workers share one launch in their common
    base folder; each worker collected every test, so each asks for the same suites. (The xdist
    controller collects nothing: it starts nothing.)"""
    wanted = list(dict.fromkeys(s for s in map(suite_of, session.items) if s))
    if wanted and not session.config.option.collectonly:
        base = session.config._tmp_path_factory.getbasetemp()
        out = (base.parent if xdist_worker(session.config) else base) / "layouts"
        session.config.stash[LAUNCH] = Layouts(out, wanted)


def pytest_sessionfinish(session, exitstatus):
    """End the launch -- under xdist, once it is done: the other worker may not have read it yet.
    (Its folder is in pytest's base folder, which pytest prunes.)"""
    launch = session.config.stash.get(LAUNCH, None)
    if launch is not None:
        launch.stop(wait=xdist_worker(session.config) and exitstatus != pytest.ExitCode.INTERRUPTED)


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """The byte-level Shakespeare corpus, prepared once per test session."""
    return prepare_bytes(tmp_path_factory.mktemp("data") / "shakespeare")


@pytest.fixture(scope="session")
def layout_suites(request):
    """Every layouts_worker suite this session's tests ask for (through their module's `runs`):
    suite -> results. One 8-rank launch, started before the first test (pytest_runtestloop): the
    group's startup is paid once, and its training works beside the tests that do not need it."""
    return request.config.stash[LAUNCH].results()
