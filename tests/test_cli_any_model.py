"""``fleetfit memory`` on the models users have: a transformers GPT-2 computing its own
loss from ``labels``, and a torch module called with keyword arguments and a nested
dict, with tied weights, returning a dict. Each is profiled, planned into a budget and
run measured under the plan and plainly (the CLI's ``main``, in this process; the
measured runs in children). The paths that take tensor workloads only refuse them in
one line."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from fleetfit.cli import main  # noqa: E402
from workloads import WorkloadError, get_workload  # noqa: E402

HF_JOBS = textwrap.dedent(
    """
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()


    def gpt2():
        # transformers GPT-2 from its config (random weights): its own loss
        cfg = GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0,
        )
        model = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
        return model, (dict(input_ids=ids, labels=ids.clone()), None), None
    """
)
JOBS = textwrap.dedent(  # torch only: its children need not import transformers
    '''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Layer(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, h, *, mask=None):
            y = self.down(F.gelu(self.up(self.ln(h))))
            return h + (y if mask is None else y * mask[..., None])


    class TiedLM(nn.Module):
        """Keyword arguments, a dict argument, tied weights, a dict output."""

        def __init__(self, vocab=256, d=32, layers=3):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.embed.weight  # one Parameter

        def forward(self, input_ids, *, extras, scale=1.0):
            h = self.embed(input_ids) * scale
            for layer in self.layers:
                h = layer(h, mask=extras["mask"])
            return {"logits": self.head(self.norm(h)), "hidden": h}


    def lm_loss(out, targets):
        return F.cross_entropy(out["logits"].flatten(0, 1), targets.flatten())


    def tied():
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, 256, (4, 33), generator=g)
        mask = torch.ones(4, 32)
        mask[0, 24:] = 0.5
        inputs = {"input_ids": tokens[:, :-1], "extras": {"mask": mask}, "scale": 2.0}
        return TiedLM(), (inputs, tokens[:, 1:]), lm_loss


    class Residual(nn.Module):
        """Tensors in and a loss_fn, but the children do not run as a chain."""

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 3)

        def forward(self, x):
            return self.b(x + self.a(x))


    def residual():
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(6, 8, generator=g), torch.randint(3, (6,), generator=g)
        return Residual(), (x, y), F.cross_entropy


    def chain():
        g = torch.Generator().manual_seed(4)
        x, y = torch.randn(6, 8, generator=g), torch.randint(3, (6,), generator=g)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        return model, (x, y), F.cross_entropy


    def garbage():
        return {"model": 42}


    def bad_inputs():
        return nn.Linear(2, 2), ("not a tensor", None), None
    '''
)
MODULE = "ffany_jobs"
HF_MODULE = "ffany_hf"
SPECS = {"gpt2": f"{HF_MODULE}:gpt2", "tied": f"{MODULE}:tied"}
ROOT = Path(__file__).resolve().parents[1]

EXPECTED_UNITS = {
    "gpt2": [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ],
    "tied": ["embed", "layers.0", "layers.1", "layers.2", "norm", "head"],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The user's module, importable here and (through PYTHONPATH) in children."""
    d = tmp_path_factory.mktemp("jobs")
    (d / f"{MODULE}.py").write_text(JOBS)
    (d / f"{HF_MODULE}.py").write_text(HF_JOBS)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(d))
    yield d
    mp.undo()
    sys.modules.pop(MODULE, None)
    sys.modules.pop(HF_MODULE, None)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(jobs):
    """Every command once per model: {name: {"profile": (code, out, err), ...}}."""
    import contextlib
    import io

    def call(*args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
        return code, out.getvalue(), err.getvalue()

    results: dict[str, dict] = {}
    for name in EXPECTED_UNITS:
        spec = SPECS[name]
        r: dict = {"profile": call("memory", "profile", "--workload", spec)}
        smallest = call("memory", "plan", "--workload", spec, "--json")
        r["smallest"] = smallest
        budget = str(last_json(smallest[1])["min_budget_bytes"] + 2**20)
        r["budget"] = int(budget)
        r["plan"] = call(
            "memory", "plan", "--workload", spec, "--memory-budget", budget, "--json"
        )
        save = str(jobs / f"{name}.safetensors")
        r["run"] = call(
            "memory",
            "run",
            "--workload",
            spec,
            "--memory-budget",
            budget,
            "--steps",
            "2",
            "--json",
            "--save",
            save,
        )
        r["save"] = save
        r["plain"] = call(
            "memory", "run", "--workload", spec, "--plain", "--steps", "2", "--json"
        )
        results[name] = r
    return results


COMMANDS = ("profile", "smallest", "plan", "run", "plain")


@pytest.mark.child
@pytest.mark.parametrize("name", list(EXPECTED_UNITS))
def test_every_command_succeeds_without_a_traceback(runs, name):
    for cmd in COMMANDS:
        code, out, err = runs[name][cmd]
        assert code == 0, (cmd, err)
        assert "Traceback" not in out + err, (cmd, err)


@pytest.mark.child
@pytest.mark.parametrize("name", list(EXPECTED_UNITS))
def test_the_units_are_listed(runs, name):
    want = EXPECTED_UNITS[name]
    _, out, err = runs[name]["profile"]
    rows = out.splitlines()
    assert rows[0].startswith("unit")
    assert [r.split()[0] for r in rows[1:]] == want
    assert "per unit" in err
    plan = last_json(runs[name]["plan"][1])
    assert plan["any_model"] is True
    assert plan["units"] == want
    assert [b["name"] for b in plan["plan"]["blocks"]] == want


@pytest.mark.child
@pytest.mark.parametrize("name", list(EXPECTED_UNITS))
def test_run_fits_its_budget_and_equals_plain(runs, name):
    planned = last_json(runs[name]["run"][1])
    plain = last_json(runs[name]["plain"][1])
    for d in (planned, plain):  # the keys of the block path's JSON, and the new ones
        for key in (
            "workload",
            "budget_bytes",
            "min_budget_bytes",
            "predicted_peak_bytes",
            "predicted_step_s",
            "plan",
            "measured_peak_bytes",
            "baseline_bytes",
            "step_s",
            "step_times_s",
            "losses",
            "within_budget",
            "any_model",
            "units",
        ):
            assert key in d, key
        assert len(d["losses"]) == 2
        assert all(math.isfinite(x) for x in d["losses"])
    assert planned["budget_bytes"] == runs[name]["budget"]
    assert planned["plan"]["num_microbatches"] > 1 or any(
        b["activations"] != "keep" or b["state"] != "resident"
        for b in planned["plan"]["blocks"]
    )  # the budget is below plain training's prediction: the plan does something
    assert planned["measured_peak_bytes"] <= planned["budget_bytes"]
    assert planned["within_budget"] is True
    assert plain["plan"] is None
    for a, b in zip(planned["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)


@pytest.mark.child
def test_save_writes_tied_weights_once(runs, jobs):
    import ffany_jobs  # type: ignore[import-not-found]
    from safetensors import safe_open

    with safe_open(runs["tied"]["save"], framework="pt") as f:
        keys = set(f.keys())
        aliases = json.loads((f.metadata() or {})["aliases"])
    assert aliases == {"head.weight": "embed.weight"}
    model = ffany_jobs.tied()[0]
    assert keys == set(model.state_dict()) - {"head.weight"}
    with safe_open(runs["gpt2"]["save"], framework="pt") as f:
        aliases = json.loads((f.metadata() or {})["aliases"])
    assert aliases == {"lm_head.weight": "transformer.wte.weight"}


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fleetfit "), err
    assert ": error: " in line, err
    for n in needles:
        assert n in line, line


@pytest.mark.parametrize(
    "fn,needle",
    [("garbage", "got dict"), ("bad_inputs", "the inputs are str")],
)
def test_a_factory_returning_garbage_fails_in_one_line(jobs, capsys, fn, needle):
    code, _, err = cli(capsys, "memory", "plan", "--workload", f"{MODULE}:{fn}")
    _one_line_error(code, err, f"{MODULE}:{fn} must return", needle)


@pytest.mark.parametrize("flag", ["--batch", "--seq"])
def test_such_a_batch_cannot_be_reshaped(jobs, capsys, flag):
    for verb in ("profile", "run"):
        code, _, err = cli(
            capsys, "memory", verb, "--workload", f"{MODULE}:tied", flag, "8"
        )
        _one_line_error(code, err, f"{MODULE}:tied", "cannot be reshaped")


def test_partition_refuses_other_models_in_one_line(jobs, capsys):
    """Partition pipelines take tensor workloads and transformers GPT-2 / Llama
    (tests/partition/test_hf_pipeline.py); other models are refused before
    profiling (federations take any model:
    tests/simulations/test_transformers_federation.py)."""
    spec = f"{MODULE}:tied"
    code, _, err = cli(
        capsys,
        "partition",
        "plan",
        "--workload",
        spec,
        "--cluster",
        str(ROOT / "partition" / "clusters" / "unequal-4.toml"),
    )
    _one_line_error(code, err, spec, "GPT-2", "fleetfit memory")


def test_registry_marks_and_guards_any_model_workloads(jobs):
    wl = get_workload(SPECS["gpt2"])
    assert wl.any_model and wl.kind == "custom" and wl.batch_size == 4
    inputs, targets, loss_fn = wl.example  # type: ignore[misc]
    assert set(inputs) == {"input_ids", "labels"} and targets is None
    assert loss_fn is None
    for call in (
        wl.example_batch,
        lambda: wl.items(),
        lambda: wl.client_items(0, 2),
        lambda: wl.batches(None, 0),  # type: ignore[arg-type]
        lambda: wl.eval_arrays(),
    ):
        with pytest.raises(WorkloadError, match="partition pipelines and ONNX"):
            call()
    # the federation's paths take it: its example batch at every step, evaluated
    assert wl.own_data and wl.data_fn is None
    batches, n = wl.node_batches(0, 2, server_round=1, local_steps=2)
    assert batches == [(inputs, None)] * 2 and n == 4
    assert set(wl.evaluate(wl.make_model())) >= {"loss", "accuracy", "perplexity"}


def test_tensor_workloads_keep_their_paths(jobs):
    from partition.run import uses_units

    chain = get_workload(f"{MODULE}:chain")
    assert not chain.any_model and not uses_units(chain)
    x, y = chain.example_batch()
    assert x.shape == (6, 8) and y.shape == (6,)
    residual = get_workload(f"{MODULE}:residual")  # federation takes it as before
    assert not residual.any_model and uses_units(residual)
    assert next(residual.batches(residual.items(), 0))[0].shape == (6, 8)
    assert not uses_units(get_workload("gpt-tiny"))


@pytest.mark.child
@pytest.mark.parametrize("name", list(EXPECTED_UNITS))
def test_run_reads_its_weights_from_a_file(runs, jobs, capsys, name):
    """``--init-state``: the model is built without its weights and read from the
    file unit by unit (``memory.materialize``); same weights, same losses as plain
    training, within the budget."""
    import importlib

    import torch

    from memory.materialize import save_state

    module, fn = SPECS[name].split(":")
    torch.manual_seed(0)  # as the measured child seeds the factory
    model = getattr(importlib.import_module(module), fn)()[0]
    path = str(jobs / f"{name}-init.safetensors")
    save_state(model, path)
    spec, budget = SPECS[name], str(runs[name]["budget"])
    code, out, err = cli(
        capsys, "memory", "run", "--workload", spec, "--memory-budget", budget,
        "--steps", "2", "--json", "--init-state", path,
    )  # fmt: skip
    assert code == 0, err
    got = last_json(out)
    plain = last_json(runs[name]["plain"][1])
    assert got["measured_peak_bytes"] <= got["budget_bytes"]
    for a, b in zip(got["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)


def test_a_bad_init_state_fails_in_one_line(jobs, capsys, tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not safetensors")
    for path, needle in ((bad, "not a safetensors file"), (tmp_path / "no", "open")):
        code, _, err = cli(
            capsys, "memory", "plan", "--workload", SPECS["tied"],
            "--init-state", str(path),
        )  # fmt: skip
        _one_line_error(code, err, "--init-state", needle)
    code, _, err = cli(
        capsys, "memory", "plan", "--workload", f"{MODULE}:chain",
        "--init-state", str(bad),
    )  # fmt: skip
    _one_line_error(code, err, "--init-state is for module:function")
