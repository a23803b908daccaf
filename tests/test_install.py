"""scripts/install picks torch's build by the machine; checked in dry-run, no network.

Each test runs a copy of the script in a temporary folder (so no `.venv` is found there)
with a stub `nvidia-smi` first on PATH and the CPU index pointed at a loopback server,
or at a closed loopback port for the unreachable case.
"""

import http.server
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
NO_GPU = "#!/bin/sh\necho 'NVIDIA-SMI has failed: no NVIDIA driver' >&2\nexit 9\n"
TORCH = "torch==2.13.0"


pytestmark = pytest.mark.child


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def cpu_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A loopback HTTP server standing in for PyTorch's CPU index."""
    folder = tmp_path_factory.mktemp("index")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: _Quiet(*a, directory=str(folder))
    )
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def closed_port_url() -> str:
    with socket.socket() as s:  # a port just released: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def dry_run(
    tmp_path: Path,
    *args: str,
    nvidia_smi: str | None,
    index: str,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "install", repo / "scripts" / "install")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(nvidia_smi)
        (bin_dir / "nvidia-smi").chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETFIT_")}
    full_env |= {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLEETFIT_TORCH_CPU_INDEX": index,
        **(env or {}),
    }
    return subprocess.run(
        ["bash", str(repo / "scripts" / "install"), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def commands(out: str) -> list[str]:
    return [
        line.removeprefix("would run: ")
        for line in out.splitlines()
        if "would run" in line
    ]


def test_no_gpu_installs_cpu_build_from_cpu_index(tmp_path: Path, cpu_index: str):
    done = dry_run(tmp_path, "--dry-run", "dev", nvidia_smi=NO_GPU, index=cpu_index)
    assert done.returncode == 0, done.stderr
    assert (
        "torch: CPU build (no NVIDIA GPU found) from PyTorch's CPU index" in done.stdout
    )
    assert commands(done.stdout) == [
        "python3 -m venv .venv",
        ".venv/bin/python -m pip install -q --upgrade pip",
        f".venv/bin/python -m pip install -q --index-url {cpu_index} {TORCH}",
        ".venv/bin/python -m pip install -q -e .[dev]",
    ]
    assert not (tmp_path / "repo" / ".venv").exists()


def test_gpu_installs_default_build(tmp_path: Path, cpu_index: str):
    done = dry_run(tmp_path, "--dry-run", nvidia_smi=GPU, index=cpu_index)
    assert done.returncode == 0, done.stderr
    assert "torch: default (CUDA) build (NVIDIA GPU found)" in done.stdout
    assert f".venv/bin/python -m pip install -q {TORCH}" in commands(done.stdout)
    assert "--index-url" not in done.stdout


def test_unreachable_cpu_index_falls_back_quickly(tmp_path: Path):
    index = closed_port_url()
    start = time.monotonic()
    done = dry_run(
        tmp_path,
        nvidia_smi=NO_GPU,
        index=index,
        env={"FLEETFIT_INSTALL_DRY_RUN": "1"},
    )
    took_s = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("torch:")]
    assert len(said) == 1, done.stdout
    assert f"CPU index {index} is unreachable" in said[0]
    assert "falling back to the default build from pip's default sources" in said[0]
    assert f".venv/bin/python -m pip install -q {TORCH}" in commands(done.stdout)
    assert "--index-url" not in done.stdout
    assert took_s < 10


@pytest.mark.parametrize(
    "choice,nvidia_smi,torch_command,said",
    [
        ("cpu", GPU, "--index-url", "torch: CPU build (FLEETFIT_TORCH=cpu)"),
        ("cuda", NO_GPU, TORCH, "torch: default (CUDA) build (FLEETFIT_TORCH=cuda)"),
        (
            "skip",
            GPU,
            None,
            "torch: not installed by this script (FLEETFIT_TORCH=skip)",
        ),
    ],
    ids=["cpu", "cuda", "skip"],
)
def test_override(
    tmp_path: Path,
    cpu_index: str,
    choice: str,
    nvidia_smi: str,
    torch_command: str | None,
    said: str,
):
    done = dry_run(
        tmp_path,
        "--dry-run",
        nvidia_smi=nvidia_smi,
        index=cpu_index,
        env={"FLEETFIT_TORCH": choice},
    )
    assert done.returncode == 0, done.stderr
    assert said in done.stdout
    installs_torch = [c for c in commands(done.stdout) if TORCH in c]
    if torch_command is None:
        assert installs_torch == []
    else:
        assert len(installs_torch) == 1 and torch_command in installs_torch[0]


def test_bad_override_fails_naming_the_choices(tmp_path: Path, cpu_index: str):
    done = dry_run(
        tmp_path,
        "--dry-run",
        nvidia_smi=NO_GPU,
        index=cpu_index,
        env={"FLEETFIT_TORCH": "gpu"},
    )
    assert done.returncode == 2
    assert "FLEETFIT_TORCH must be cpu, cuda or skip, not 'gpu'" in done.stderr


def test_working_torch_in_venv_is_kept(tmp_path: Path, cpu_index: str):
    python = tmp_path / "repo" / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 2.13.0+cpu\n")  # answers `import torch`
    python.chmod(0o755)
    done = dry_run(tmp_path, "--dry-run", nvidia_smi=NO_GPU, index=cpu_index)
    assert done.returncode == 0, done.stderr
    assert "torch: keeping 2.13.0+cpu already in .venv" in done.stdout
    assert "python3 -m venv .venv" not in commands(done.stdout)
    assert not any(TORCH in c for c in commands(done.stdout))
