"""tests/tiers.py, run on a suite of its own in one pytest subprocess: the tiers are
selected and enforced, markers are strict, and the reaper kills what a test leaves."""

from __future__ import annotations

import os
import textwrap

import psutil
import pytest

SUITE = """
import os, subprocess, sys, time
import pytest

def test_quiet():
    pass

def test_starts_unmarked():
    subprocess.run(["true"], check=True)

@pytest.mark.child
def test_one_at_a_time():
    subprocess.run(["true"], check=True)
    subprocess.run(["true"], check=True)

@pytest.mark.child
def test_two_at_once():
    a = subprocess.Popen(["sleep", "2"])
    b = subprocess.Popen(["sleep", "2"])
    a.wait(); b.wait()

@pytest.mark.child
def test_a_heavy_command():
    subprocess.run(["sh", "-c", "exit 0", "flower-superlink"], check=True)

@pytest.mark.child
def test_a_heavy_descendant():
    # the test's command line names nothing heavy; the process it becomes does
    env = dict(os.environ, N="flower-superlink")
    subprocess.run(["bash", "-c", 'exec -a "$N" sleep 2'], env=env, check=True)

@pytest.mark.child
def test_leaves_a_process():
    p = subprocess.Popen(["sleep", "300"])
    with open("left.pid", "w") as f:
        f.write(str(p.pid))

@pytest.mark.simulation
def test_simulation_is_heavy():
    a = subprocess.Popen(["sleep", "1"])
    b = subprocess.Popen(["sleep", "1"])
    a.wait(); b.wait()
"""


@pytest.fixture
def suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini(
        textwrap.dedent(
            """
            [pytest]
            addopts = --strict-markers -p tests.tiers -p no:cacheprovider
            testpaths = .
            markers =
                child: one at a time
                heavy: many
                simulation: Ray
                deployment: SuperLink
            """
        )
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", repo)
    return pytester


@pytest.mark.heavy  # its inner suite runs what it must refuse in tier child
def test_tiers_are_selected_enforced_and_reaped(suite: pytest.Pytester) -> None:
    # a bare run: the default tier only
    r = suite.runpytest_subprocess()
    r.assert_outcomes(passed=2, errors=1, deselected=6)  # a teardown error: passed + 1
    r.stdout.fnmatch_lines(["*default-tier test started a process (true)*mark it*"])
    # one tier
    r = suite.runpytest_subprocess("--tier", "child", "-k", "not leaves")
    r.assert_outcomes(passed=4, errors=3, deselected=4)
    r.stdout.fnmatch_lines(["*while another of its own still ran*@pytest.mark.heavy*"])
    r.stdout.fnmatch_lines(["*started a heavy tier's process*flower-superlink*"])
    r.stdout.fnmatch_lines(["*ran a heavy tier's process (flower-superlink 2)*"])
    # naming the file runs every tier; the reaper kills what a test left
    r = suite.runpytest_subprocess("test_suite.py", "-k", "leaves or simulation")
    r.assert_outcomes(passed=2, errors=1, deselected=6)
    r.stdout.fnmatch_lines(
        ["*left 1 process(es) running after its teardown, killed*sleep 300*"]
    )
    pid = int((suite.path / "left.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


@pytest.mark.child
def test_an_unknown_marker_is_an_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_typo="import pytest\n@pytest.mark.chlid\ndef test_x():\n    pass\n"
    )
    r = suite.runpytest_subprocess("test_typo.py")
    assert r.ret != 0
    r.stdout.fnmatch_lines(["*'chlid' not found in `markers` configuration option*"])


@pytest.mark.heavy  # two xdist workers
def test_the_tiers_groups_keep_measuring_tests_on_one_worker(
    suite: pytest.Pytester,
) -> None:
    """Under ``-n 2 --dist loadgroup`` every test that starts a process runs in its
    group (``@measure``), one worker; a Ray simulation and the default tier have
    none. A pytest-xdist or pytest release that stops honouring the groups fails
    here, not silently (pytest-dev/pytest-xdist#1386)."""
    pytest.importorskip("xdist")
    r = suite.runpytest_subprocess(
        "test_suite.py",
        "-n",
        "2",
        "--dist",
        "loadgroup",
        "-v",
        "-k",
        "one_at_a_time or quiet or simulation",
    )
    r.stdout.fnmatch_lines_random(
        [
            "*PASSED test_suite.py::test_one_at_a_time@measure*",
            "*PASSED test_suite.py::test_simulation_is_heavy *",
            "*PASSED test_suite.py::test_quiet *",
        ]
    )


@pytest.mark.parametrize(
    ("command", "heavy"),
    [
        ("/venv/bin/flower-superlink --insecure", True),
        ("/venv/bin/flwr run . local", True),
        ("/venv/lib/python3.12/site-packages/ray/core/src/ray/raylet/raylet", True),
        ("/usr/sbin/nginx -p /tmp/w -c /tmp/w/nginx.conf -e /tmp/proxy.log", True),
        ("/usr/sbin/nginx -p /tmp/w -c /tmp/w/nginx.conf -e /tmp/proxy.log -t", False),
        ("torchrun --nproc-per-node 3 train.py", True),
        ("torchrun --nproc-per-node=2 train.py", False),
        ("/venv/bin/python -m fleetfit memory plan gpt-byte", False),
    ],
)
def test_heavy_commands(command: str, heavy: bool) -> None:
    """A serving nginx is heavy; ``nginx -t`` (a config check) is one child."""
    from tests.tiers import _HEAVY_COMMANDS

    assert bool(_HEAVY_COMMANDS.search(command)) is heavy
