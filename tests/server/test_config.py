import pytest

from server.config import ServerConfig


def test_defaults_and_roundtrip():
    cfg = ServerConfig()
    assert ServerConfig.from_run_config(cfg.to_run_config()) == cfg


@pytest.mark.parametrize(
    "key,value,msg",
    [
        ("num-server-rounds", -1, "num-server-rounds=-1"),
        ("num-server-rounds", 0, "at least 1"),
        ("local-steps", 0, "local-steps=0"),
        ("lr", -0.1, "lr=-0.1"),
        ("split", "zipf", "split='zipf'"),
        ("fraction-train", 1.5, "fraction-train=1.5"),
        ("min-nodes", 0, "min-nodes=0"),
        ("eval-windows", 0, "eval-windows=0"),
        ("num-server-rounds", "3", "must be a int"),
        ("bogus", 1, "unknown run-config key"),
    ],
)
def test_bad_run_config_names_the_value(key, value, msg):
    with pytest.raises(ValueError, match=msg):
        ServerConfig.from_run_config({key: value})
