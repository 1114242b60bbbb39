"""A small ``communities compare`` spec over the tiny config: 2 ranks, 2 seeds, community and a gossip variant."""
from pathlib import Path


def write_spec(tmp_path, tiny_config, **extra) -> Path:
    """Write spec.yaml in tmp_path; keyword arguments replace top-level keys of the spec."""
    spec = {"name": "tinycmp", "base": str(tiny_config), "world_size": 2, "seeds": [0, 1], "target_accuracy": 0.5,
            "overrides": ["train.budget=20"], "strategies": ["community", {"name": "gossip_fast",
                                                                          "strategy": "gossip",
                                                                          "overrides": ["merge.lam=1"]}]}
    spec.update(extra)
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
