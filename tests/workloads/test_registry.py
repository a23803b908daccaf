import subprocess
import sys
import textwrap

import pytest
import torch

from workloads import WorkloadError, get_workload
from workloads.registry import child_env

USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        x = torch.randn(6, 5)
        y = torch.randint(3, (6,))
        return model, (x, y), nn.functional.cross_entropy

    def broken():
        return 42
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "myjob.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    yield "myjob"
    sys.modules.pop("myjob", None)


def test_module_function_workload_from_current_directory(user_module):
    wl = get_workload(f"{user_module}:build")
    assert wl.kind == "custom" and wl.batch_size == 6
    x, y = wl.example_batch()
    a, b = wl.make_model(1), wl.make_model(1)
    assert torch.equal(a(x), b(x))
    assert torch.isfinite(wl.loss_fn(a(x), y))


@pytest.mark.child
def test_module_function_loads_in_a_child_process(user_module):
    code = "from workloads import get_workload; print(get_workload('myjob:build').kind)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "custom"


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("nope", "unknown workload 'nope'"),
        ("a:b:c", "malformed workload 'a:b:c'"),
        ("my job:build", "malformed workload"),
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("workloads.models:no_such_function", "has no function 'no_such_function'"),
        ("json:loads", "json is Python's standard library"),
        ("", "workload must be"),
    ],
)
def test_bad_workload_names(spec, msg):
    with pytest.raises(WorkloadError, match=msg):
        get_workload(spec)


def test_function_with_wrong_return(user_module):
    with pytest.raises(WorkloadError, match="must return"):
        get_workload(f"{user_module}:broken")


def test_shape_overrides_validated():
    assert get_workload("gpt-tiny", batch_size=2, seq_len=16).seq_len == 16
    with pytest.raises(WorkloadError, match="sequence length"):
        get_workload("gpt-tiny", seq_len=1000)
    with pytest.raises(WorkloadError, match="batch size"):
        get_workload("digits-cnn", batch_size=0)
    with pytest.raises(WorkloadError, match="language models only"):
        get_workload("digits-cnn", seq_len=8)


def test_eval_windows_bound_a_language_models_central_evaluation():
    """``eval_windows``: the first N held-out windows, as many tokens as that, and
    the same figures as the default evaluation restricted to those windows."""
    import torch

    wl = get_workload("gpt-tiny", seq_len=16, eval_windows=3)
    assert wl.eval_windows == 3
    x, y = wl.eval_arrays()
    assert x.shape == (3, 16) and y.shape == (3, 16)
    full_x, _ = get_workload("gpt-tiny", seq_len=16).eval_arrays()
    assert len(full_x) > 3 and (full_x[:3] == x).all()
    model = wl.make_model(0)
    got = wl.evaluate(model)
    with torch.no_grad():
        out = model(torch.as_tensor(x))
        want = torch.nn.functional.cross_entropy(
            out.reshape(-1, out.shape[-1]), torch.as_tensor(y).reshape(-1)
        )
    assert got["loss"] == pytest.approx(float(want), rel=1e-5)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(WorkloadError, match="eval windows"):
            get_workload("gpt-tiny", eval_windows=bad)
