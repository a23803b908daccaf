"""A process that loads the ClientApp turns MKL's buffer pool off before torch loads
(``client/__init__.py``), as the measuring children do, unless its environment says
otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = (
    "import client.app, os, sys; "
    "print(os.environ.get('MKL_DISABLE_FAST_MM'), 'torch' in sys.modules)"
)


def _run(env: dict[str, str]) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**env, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.child
def test_the_client_app_sets_the_mkl_setting_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    assert _run(env) == "1 True"  # set, and torch loaded after it (by client.app)
    assert _run({**env, "MKL_DISABLE_FAST_MM": "0"}) == "0 True"  # the node's own
