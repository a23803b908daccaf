import pytest
import torch
from safetensors.torch import save_file

from memory.errors import MemoryPlanError
from memory.tensorfile import TensorFile


def test_reads_what_safetensors_wrote(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "d": torch.ones(0),
        "e": torch.tensor(7, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "t.safetensors", metadata={"x": "y"})
    with TensorFile(tmp_path / "t.safetensors") as f:
        assert sorted(f.keys()) == ["a", "b", "c", "d", "e"]
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got, v)
        with pytest.raises(MemoryPlanError, match="no tensor 'z'"):
            f.get_tensor("z")


def test_truncated_and_foreign_files(tmp_path):
    save_file({"a": torch.randn(100)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-50])
    with pytest.raises(MemoryPlanError, match="bad entry"):
        TensorFile(tmp_path / "cut.safetensors")
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04 this is a zip, not safetensors")
    with pytest.raises(MemoryPlanError, match="not a safetensors file"):
        TensorFile(tmp_path / "x.bin")
    with pytest.raises(MemoryPlanError, match="cannot open"):
        TensorFile(tmp_path / "missing.safetensors")
