"""Bad input, property-based: every malformed value gets a clear error (a
``ValueError`` naming the value) or a logged rejection, fast, and changes no state.

Inputs: size strings, run configs, node configs, workload names, cluster files, model
updates, model and resume-state files. Example counts are kept small (see
``EXAMPLES``) so that the file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from client.config import NodeConfig, check_workload_allowed
from memory.errors import MemoryPlanError
from memory.sizes import parse_bytes
from partition.cluster import Cluster, ClusterError, load_cluster
from server.aggregate import Update, UpdateRejected, accept_updates, validate_update
from server.config import ServerConfig
from server.persist import CheckpointError, load_model, load_state, save_model
from tests.test_cli_errors import no_start  # noqa: F401  (a fixture)
from workloads import BUILTIN_WORKLOADS, WorkloadError, get_workload

pytestmark = pytest.mark.timeout(120)  # a parser that hangs on a value fails, fast

EXAMPLES = 60
common = settings(
    max_examples=EXAMPLES,
    deadline=2000,  # ms: a parser that hangs on a value (10 ** 1e9) fails here
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# Values of every type a TOML file or a Flower config record can carry.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.lists(st.integers(), max_size=3),
)
units = st.sampled_from(
    ["", "B", "b", "k", "kB", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "PB"]
    + ["X", "MiBs", "gib ", " ", "e", "-"]
)
number_text = st.from_regex(
    r"\A[+-]?[0-9]{0,400}(\.[0-9]{0,5})?([eE][+-]?[0-9]{1,12})?\Z", fullmatch=True
)


def named(error: BaseException, value: object) -> bool:
    """Whether the message names ``value`` (its repr, or a prefix of a long one)."""
    text = str(error)
    shown = repr(value)
    return shown[:40] in text or str(value)[:40] in text


# ---------------------------------------------------------------- size strings
@common
@given(st.one_of(st.text(max_size=40), st.tuples(number_text, units).map("".join)))
def test_size_strings_parse_or_fail_naming_the_value(text):
    try:
        n = parse_bytes(text, what="memory-budget")
    except MemoryPlanError as e:
        assert "memory-budget" in str(e) and named(e, text), str(e)
    else:
        assert isinstance(n, int) and n > 0


@common
@given(st.one_of(scalars, st.integers(min_value=2**1000, max_value=2**1100)))
def test_sizes_of_any_type(value):
    try:
        n = parse_bytes(value, what="disk-budget", allow_zero=True)
    except MemoryPlanError as e:
        assert "disk-budget" in str(e), str(e)
    else:
        assert isinstance(n, int) and n >= 0


@common
@given(st.integers(min_value=1, max_value=2**50), st.sampled_from(["", "kB", "MiB"]))
@example(n=72_057_594_037_929, unit="kB")  # once: 72057594037928992 (float rounding)
def test_good_sizes_are_exact(n, unit):
    scale = {"": 1, "kB": 1000, "MiB": 2**20}[unit]
    assert parse_bytes(f"{n}{unit}") == n * scale
    assert parse_bytes(f" {n} {unit} ") == n * scale


@common
@given(st.integers(min_value=1, max_value=2**60))
def test_decimal_forms_are_exact(n):
    # n/1000 kB, n*10**-3 kB and n e-3 kB are all n bytes, with no float rounding
    text = f"{n // 1000}.{n % 1000:03d}"
    assert parse_bytes(f"{text}kB") == n
    assert parse_bytes(f"{n}e-3kB") == n
    assert parse_bytes(f"{n}.0") == n
    with pytest.raises(MemoryPlanError, match="whole number"):
        parse_bytes(f"{n}.5")


def test_sizes_above_the_largest_are_refused():
    assert parse_bytes(2**80) == 2**80
    for text in (2**80 + 1, "1e31", "1.3e24", "1e999999999GB", f"1e{'9' * 5000}"):
        with pytest.raises(MemoryPlanError, match="too large"):
            parse_bytes(text)


# ---------------------------------------------------------------- run configs
RUN_KEYS = sorted(ServerConfig().to_run_config())


@common
@given(
    st.dictionaries(
        st.one_of(st.sampled_from(RUN_KEYS), st.text(max_size=12)),
        scalars,
        max_size=4,
    )
)
def test_run_configs_parse_or_fail_naming_the_key(run_config):
    try:
        cfg = ServerConfig.from_run_config(run_config)
    except ValueError as e:
        assert any(k in str(e) for k in run_config), str(e)
    else:
        assert cfg.num_server_rounds >= 1 and cfg.shape.local_steps >= 1
        assert math.isfinite(cfg.shape.lr) and cfg.shape.lr > 0
        assert ServerConfig.from_run_config(cfg.to_run_config()) == cfg


# ---------------------------------------------------------------- node configs
NODE_KEYS = [
    "partition-id",
    "num-partitions",
    "memory-budget",
    "disk-budget",
    "allow-workloads",
]


@common
@given(st.dictionaries(st.sampled_from(NODE_KEYS), scalars, max_size=5))
def test_node_configs_parse_or_fail_naming_the_key(node_config):
    node_config.setdefault("disk-budget", "1GB")  # no measuring of the disk
    try:
        node = NodeConfig.from_node_config(node_config)
    except ValueError as e:
        assert any(k in str(e) for k in NODE_KEYS), str(e)
    else:
        assert 0 <= node.partition_id < node.num_partitions
        assert node.budget_bytes > 0 and node.disk_budget_bytes >= 0


# ---------------------------------------------------------------- workload names
identifiers = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,10}\Z", fullmatch=True)


@common
@given(st.text(max_size=30))
def test_workload_names_are_refused_or_built_in(name):
    if ":" in name:
        # a node refuses any module:function its operator did not allow
        with pytest.raises(ValueError, match="allow-workloads"):
            check_workload_allowed(name, {})
        return
    if name in BUILTIN_WORKLOADS:
        assert get_workload(name).name == name
        return
    with pytest.raises(WorkloadError) as e:
        get_workload(name)
    assert named(e.value, name), str(e.value)


@common
@given(identifiers, identifiers)
def test_missing_modules_are_a_workload_error(module, function):
    spec = f"zz_fleetfit_missing_{module}:{function}"  # never an installed module
    with pytest.raises(WorkloadError, match="cannot import module"):
        get_workload(spec)


USER_MODULE = """
import functools
from os import system

import torch

CALLS = []


def needs(x):
    CALLS.append(x)


def build(width=4):
    CALLS.append("build")
    batch = (torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    return torch.nn.Linear(2, width), batch, torch.nn.functional.cross_entropy


small = functools.partial(build, width=3)
"""


@pytest.mark.parametrize(
    "spec, why",
    [
        ("os:system", "os is Python's standard library"),
        ("builtins:print", "builtins is Python's standard library"),
        ("code:interact", "code is Python's standard library"),  # would read stdin
        ("ff_user_jobs:system", "a built-in function"),  # os.system imported
        ("ff_user_jobs:needs", "it takes arguments (x)"),
        ("numpy:zeros", "a built-in function"),
    ],
)
def test_a_function_that_is_not_a_workload_is_not_called(
    tmp_path, monkeypatch, spec, why
):
    """``os:system`` was called with no argument (a ``TypeError`` traceback in every
    command): what cannot be a workload function is refused before the call."""
    (tmp_path / "ff_user_jobs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError) as e:
        get_workload(spec)
    assert f"workload {spec!r} is not a workload function ({why})" in str(e.value)
    import ff_user_jobs

    assert ff_user_jobs.CALLS == []


def test_workload_functions_with_defaults_and_partials_load(tmp_path, monkeypatch):
    (tmp_path / "ff_user_jobs2.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_workload("ff_user_jobs2:build").make_model().out_features == 4
    assert get_workload("ff_user_jobs2:small").make_model().out_features == 3


# ---------------------------------------------------------------- cluster files
hosts = st.lists(
    st.dictionaries(
        st.sampled_from(["name", "devices", "memory", "compute", "peak", "gpu"]),
        scalars,
        max_size=5,
    ),
    max_size=3,
)
clusters = st.dictionaries(
    st.sampled_from(["name", "network", "hosts", "links", "extra"]),
    st.one_of(
        scalars,
        hosts,
        st.dictionaries(st.sampled_from(["bandwidth", "latency"]), scalars),
        st.lists(st.dictionaries(st.sampled_from(["hosts", "bandwidth"]), scalars)),
    ),
    max_size=4,
)


@common
@given(clusters)
def test_cluster_descriptions_load_or_fail_with_a_cluster_error(d):
    try:
        c = Cluster.from_dict(d, probe=lambda: 1e9)
    except ClusterError as e:
        assert str(e)
    else:
        assert c.num_devices >= 1
        assert all(x.memory_bytes > 0 and x.flops_per_s > 0 for x in c.devices)


@common
@given(st.binary(max_size=200))
def test_cluster_files_of_random_bytes(tmp_path, data):
    path = tmp_path / "c.toml"
    path.write_bytes(data)
    with pytest.raises(ClusterError, match="c.toml|hosts|cluster"):
        load_cluster(path)


HOST = '[[hosts]]\nname = "a"\nmemory = "1GB"\ncompute = 1\n'


@pytest.mark.parametrize(
    "text",
    [
        '[[hosts]]\nmemory = "1e999999999GB"\ncompute = 1',  # once: 10 ** 999999999
        "links = 3\n" + HOST,  # once: TypeError
        HOST + '[[links]]\nhosts = [["a"], "a"]',  # once: TypeError (unhashable)
        HOST.replace("1GB", "1e400"),
    ],
)
def test_cluster_files_found_by_hand(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ClusterError):
        load_cluster(path)


# ---------------------------------------------------------------- model updates
def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "n": torch.tensor(7, dtype=torch.int64),
    }


def update(state, num_examples=10, pid=0):
    return Update(pid, 100 + pid, num_examples, state)


def trained(pid: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + pid)
    return {
        k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
        for k, v in reference().items()
    }


MUTATIONS = ["nan", "inf", "shape", "dtype", "missing", "extra", "examples", "type"]


@common
@given(
    st.sampled_from(MUTATIONS),
    st.sampled_from(["w", "b", "n"]),
    st.integers(min_value=0, max_value=11),
    st.integers(min_value=-5, max_value=0),
)
def test_malformed_updates_are_rejected_naming_the_cause(how, key, index, examples):
    ref = reference()
    state = trained(0)
    t = state[key]
    if how in ("nan", "inf"):
        assume(t.is_floating_point())
        t = t.clone()
        t.view(-1)[index % t.numel()] = float(how)
        state[key] = t
        expect = f"{key}: contains NaN or Inf"
    elif how == "shape":
        state[key] = torch.zeros(t.numel() + 1 + index, dtype=t.dtype)
        expect = f"{key}: shape"
    elif how == "dtype":
        state[key] = t.to(torch.float64 if t.is_floating_point() else torch.int32)
        expect = f"{key}: dtype"
    elif how == "missing":
        del state[key]
        expect = f"missing ['{key}']"
    elif how == "extra":
        state[f"{key}.evil"] = t
        expect = f"unexpected ['{key}.evil']"
    elif how == "type":
        state[key] = t.to(torch.float16) if t.is_floating_point() else t.float()
        expect = f"{key}: dtype"
    else:
        with pytest.raises(UpdateRejected, match=f"num-examples is {examples}"):
            validate_update(update(state, examples), ref)
        return
    with pytest.raises(UpdateRejected) as e:
        validate_update(update(state), ref)
    assert expect in str(e.value)
    before = {k: v.clone() for k, v in ref.items()}
    accepted, rejected = accept_updates([update(state)], ref, norm_factor=10)
    assert not accepted and len(rejected) == 1
    assert all(torch.equal(before[k], ref[k]) for k in ref)  # nothing changed


@common
@given(st.floats(min_value=30.0, max_value=1e30), st.integers(2, 5))
def test_enormous_updates_are_rejected_by_the_norm_bound(scale, num_honest):
    ref = reference()
    honest = [update(trained(p), pid=p) for p in range(num_honest)]
    big = {
        k: ref[k] + scale * (v - ref[k]) if v.is_floating_point() else v
        for k, v in trained(99).items()
    }
    accepted, rejected = accept_updates(
        [*honest, update(big, pid=99)], ref, norm_factor=10
    )
    assert [u.partition_id for u, _ in rejected] == [99]
    assert "norm: relative change" in rejected[0][1]
    assert len(accepted) == num_honest


# ---------------------------------------------------------------- model files
def good_model(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_model(path, reference(), {"round": "3", "workload": "digits-cnn"})
    return path


@common
@given(st.data())
def test_truncated_model_files_are_refused(tmp_path, data):
    good = good_model(tmp_path).read_bytes()
    cut = data.draw(st.integers(min_value=0, max_value=len(good) - 1))
    path = tmp_path / "cut.safetensors"
    path.write_bytes(good[:cut])
    with pytest.raises(CheckpointError, match="cut.safetensors"):
        load_model(path)


@common
@given(st.binary(max_size=300))
def test_random_bytes_are_refused(tmp_path, data):
    path = tmp_path / "random.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="random.safetensors"):
        load_model(path)


class Boom:
    """Unpickling this writes a file: proof that a loader ran pickle."""

    def __reduce__(self):
        return (Path.write_text, (Path(os.environ["BOOM_FILE"]), "unpickled"))


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickle_is_never_unpickled(tmp_path, monkeypatch, how):
    boom = tmp_path / "boom.txt"
    monkeypatch.setenv("BOOM_FILE", str(boom))
    path = tmp_path / "model.safetensors"
    if how == "pickle":
        path.write_bytes(pickle.dumps({"w": Boom()}))
    else:
        torch.save({"w": torch.zeros(3), "x": Boom()}, path)
    with pytest.raises(CheckpointError, match="never pickle"):
        load_model(path)
    assert not boom.exists()


# ---------------------------------------------------------------- resume state
def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A real run folder after 1 round (digits-cnn, 2 in-process nodes)."""
    from tests.server.grid import FakeGrid
    from tests.server.test_federation import config, federate, nodes

    tmp = tmp_path_factory.mktemp("resume")
    federate(config(tmp, num_server_rounds=1), FakeGrid(nodes(2)))
    return tmp / "run"


STATE_DAMAGE = {
    "model truncated": lambda s: _cut(s / "model-000001.safetensors"),
    "model replaced by a pickle": lambda s: (
        s / "model-000001.safetensors"
    ).write_bytes(pickle.dumps({"w": [1, 2]})),
    "model missing": lambda s: (s / "model-000001.safetensors").unlink(),
    "state.json truncated": lambda s: _cut(s / "state.json"),
    "state.json not utf-8": lambda s: (s / "state.json").write_bytes(b"\xff\xfe{"),
    "state.json a list": lambda s: (s / "state.json").write_text("[1, 2]"),
    "model name escapes": lambda s: _edit(s, model="../model.safetensors"),
    "round is a string": lambda s: _edit(s, round="1"),
    "round mismatch": lambda s: _edit(s, round=2, model="model-000001.safetensors"),
}


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit(state_dir: Path, **changes) -> None:
    state = json.loads((state_dir / "state.json").read_text())
    (state_dir / "state.json").write_text(json.dumps({**state, **changes}))


@pytest.mark.parametrize("damage", sorted(STATE_DAMAGE))
def test_a_damaged_state_folder_fails_the_resume_and_is_left_alone(
    run_folder, tmp_path, damage
):
    import shutil

    from server.loop import Federation
    from tests.server.grid import FakeGrid
    from tests.server.test_federation import config, nodes

    out = tmp_path / "run"
    shutil.copytree(run_folder, out)
    STATE_DAMAGE[damage](out / "state")
    before = digest(out)
    with pytest.raises(CheckpointError, match="state") as e:
        load_state(out)
    assert "move it away" in str(e.value)
    cfg = config(tmp_path, num_server_rounds=2, resume=True)
    from server.app import FlowerTransport

    fed = Federation(cfg, FlowerTransport(FakeGrid(nodes(2)), query_config={}))
    with pytest.raises(CheckpointError):
        fed.run()
    assert digest(out) == before  # nothing deleted, nothing overwritten


def test_the_undamaged_state_folder_resumes(run_folder, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_folder, out)
    saved = load_state(out)
    assert saved is not None and saved[0] == 1
    assert set(saved[1]) == set(get_workload("digits-cnn").make_model(0).state_dict())
    assert [r["round"] for r in saved[2]["rounds"]] == [1]


STATE_DAMAGE_BY_COMMAND = {
    **STATE_DAMAGE,
    "model of another workload": lambda s: save_model(
        s / "model-000001.safetensors",
        get_workload("digits-mlp").make_model(0).state_dict(),
        {"round": "1"},
    ),
}
"""``STATE_DAMAGE``, and a model file that loads but is not this workload's."""


@pytest.mark.usefixtures("no_start")
@pytest.mark.parametrize(
    "damage, flags, needles",
    [
        *((d, [], ["state", "move it away"]) for d in sorted(STATE_DAMAGE)),
        (
            "model of another workload",
            [],
            ["does not fit digits-cnn", "Missing key(s)"],
        ),
        (None, ["--workload", "digits-mlp"], ["workload='digits-cnn'", "--out"]),
        (None, ["--seed", "3"], ["seed=0", "seed=3"]),
    ],
)
def test_the_server_command_refuses_a_bad_resume_before_it_starts(
    run_folder, tmp_path, capsys, damage, flags, needles
):
    """Found by ``fleetfit server`` before the SuperLink starts, as one line naming
    the file or setting and the fix; it was a relayed ServerApp traceback after
    30-45 s, with ``flwr run exit 0`` last."""
    import shutil

    from tests.test_cli_errors import refused

    out = tmp_path / "run"
    shutil.copytree(run_folder, out)
    if damage is not None:
        STATE_DAMAGE_BY_COMMAND[damage](out / "state")
    before = digest(out)
    argv = ["server", "--out", str(out), "--resume", *flags]
    line = refused(capsys, argv, *needles)
    assert str(out) in line, line
    assert digest(out) == before


def test_the_undamaged_state_folder_passes_the_command_check(run_folder, tmp_path):
    import shutil

    from server.precheck import check_start
    from tests.server.test_federation import config

    shutil.copytree(run_folder, tmp_path / "run")
    check_start(config(tmp_path, num_server_rounds=2, resume=True))  # no error


def init_models(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Bad ``init-model`` files for digits-cnn, and what the error says of each."""
    state = get_workload("digits-cnn").make_model(0).state_dict()
    nan = {k: v.clone() for k, v in state.items()}
    nan["0.0.bias"][3] = math.nan
    inf = {k: v.clone() for k, v in state.items()}
    inf["3.weight"][0, 0] = -math.inf
    files = {
        "nan": (nan, "'0.0.bias' holds 1 NaN or infinite"),
        "inf": (inf, "'3.weight' holds 1 NaN or infinite"),
        "other workload": (
            get_workload("digits-mlp").make_model(0).state_dict(),
            "does not fit digits-cnn",
        ),
        "other shapes": (
            get_workload("digits-cnn@0.5").make_model(0).state_dict(),
            "size mismatch",
        ),
    }
    out: dict[str, tuple[Path, str]] = {}
    for name, (tensors, needle) in files.items():
        path = tmp_path / f"{name.replace(' ', '-')}.safetensors"
        save_model(path, tensors, {})
        out[name] = (path, needle)
    (tmp_path / "pickle.safetensors").write_bytes(pickle.dumps({"w": [1]}))
    out["not safetensors"] = (tmp_path / "pickle.safetensors", "never pickle")
    out["missing"] = (tmp_path / "none.safetensors", "no model file")
    return out


INIT_MODELS = ["nan", "inf", "other workload", "other shapes", "not safetensors"]


@pytest.mark.usefixtures("no_start")
@pytest.mark.parametrize("bad", [*INIT_MODELS, "missing"])
def test_the_server_command_refuses_a_bad_init_model_before_it_starts(
    tmp_path, capsys, bad
):
    from tests.test_cli_errors import refused

    path, needle = init_models(tmp_path)[bad]
    argv = ["server", "--out", str(tmp_path / "run")]
    line = refused(capsys, [*argv, "--run-config", f'init-model="{path}"'], needle)
    assert f"init-model={str(path)!r}" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", INIT_MODELS)
def test_the_server_app_and_simulate_refuse_a_bad_init_model(tmp_path, bad):
    """The ServerApp itself (``Federation``) and ``fleetfit simulate``'s check before
    Ray refuse what the command refuses: a NaN model was accepted."""
    from server.app import FlowerTransport
    from server.loop import Federation
    from simulations.run import SimulationSettings
    from tests.server.grid import FakeGrid
    from tests.server.test_federation import config, nodes

    path, needle = init_models(tmp_path)[bad]
    cfg = config(tmp_path, init_model=str(path))
    with pytest.raises(ValueError, match=needle):
        Federation(cfg, FlowerTransport(FakeGrid(nodes(1)), query_config={}))
    settings = SimulationSettings(num_clients=2, init_model=str(path), out=cfg.out)
    with pytest.raises(ValueError, match=needle):
        settings.validate()
    assert not Path(cfg.out).exists()


# ---------------------------------------------------------------- reply metrics
@pytest.mark.parametrize("loss", [[1.0, 2.0], float("nan")])
def test_a_malformed_train_loss_is_data_not_a_crash(tmp_path, loss):
    from tests.server.grid import FakeGrid
    from tests.server.test_federation import config, federate, nodes

    def tamper(node_id, reply):
        if node_id == 2000 and reply.metadata.message_type == "train":
            reply.content.metric_records["metrics"]["train-loss"] = loss
        return reply

    summary = federate(
        config(tmp_path, num_server_rounds=1), FakeGrid(nodes(2), tamper=tamper)
    )
    text = (tmp_path / "run" / "summary.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json has {c}"))
    assert summary["rounds"][0]["num_clients"] >= 1
