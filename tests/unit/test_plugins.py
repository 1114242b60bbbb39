"""Your own data and model (docs/guides/own-model-and-data.md) without MPI: the documented example, the keywords a
function gets, the forms a dataset may take, and the clean errors of `communities validate`'s dry run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from communities import cli, config, console
from communities.errors import DataError, ModelError
from communities.workload import data, models, plugins
from tests.helpers.mpi import ROOT
from tests.helpers.plugin_docs import doc_blocks, doc_commands, doc_dry_run

EXAMPLE = ROOT / "examples" / "plugins"


def test_the_shipped_example_is_the_one_in_the_docs():
    blocks = doc_blocks()
    assert set(blocks) == {"examples/plugins/my_data.py", "examples/plugins/config.yaml"}
    for path, text in blocks.items():
        assert (ROOT / path).read_text() == text, f"{path} differs from its block in docs/guides/own-model-and-data.md"


def validate(*args, cwd):
    return subprocess.run([sys.executable, "-m", "communities", "validate", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_validate_follows_the_docs_from_another_directory(tmp_path):
    """The docs' validate command, run from elsewhere: my_data is imported from the config's directory."""
    command = doc_commands()[0].split()
    assert command[:2] == ["communities", "validate"]
    res = validate(*[EXAMPLE / "config.yaml" if a == "examples/plugins/config.yaml" else a for a in command[2:]],
                   cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "name: plugins_example" in res.stdout
    for line in doc_dry_run():
        assert line in res.stderr  # the dry run the docs show, line for line


def test_the_installed_command_imports_hooks_from_the_current_directory(tmp_path):
    """``mymod.py`` in the current directory, the config elsewhere: the console script finds it (issue 13)."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mymod.py").write_text((EXAMPLE / "my_data.py").read_text())
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "c.yaml").write_text("data: {dataset: 'mymod:blobs'}\nmodel: {name: 'mymod:tiny_mlp'}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([str(Path(sys.executable).parent / "communities"), "validate", "../configs/c.yaml"],
                         cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "name: c\n" in res.stdout and "communities: model: mymod:tiny_mlp: 195 parameters" in res.stderr


@pytest.mark.parametrize("override, needle", [
    ("data.dataset=no_such_module:load", "data.dataset='no_such_module:load': no module named 'no_such_module'"),
    ("model.name=my_data:no_such_fn", "my_data.py has no 'no_such_fn'"),
    ("model.name=tests.unit.test_plugins:model_with_wrong_signature",
     "model_with_wrong_signature(width, depth) cannot be called as def fn(input_shape, n_classes) -> "
     "torch.nn.Module: parameter 'width' is not one communities passes"),
    ("data.dataset=tests.unit.test_plugins:not_deterministic",
     "two calls of not_deterministic() gave different training sets and test splits; is it deterministic?"),
    ("data.dataset=tests.unit.test_plugins:three_values", "must return (x_train, y_train, x_test, y_test)"),
    ("model.name=tests.unit.test_plugins:wrong_logits", "returns shape (4, 7) for a batch of 4; expected (4, 3)"),
])
def test_validate_calls_the_hooks_and_names_what_is_wrong(monkeypatch, capsys, override, needle):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # validate adds the config's directory
    assert cli.main(["validate", str(EXAMPLE / "config.yaml"), override, "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.count("\n") == 1  # one line


def model_with_wrong_signature(width, depth):
    return torch.nn.Linear(width, depth)


def wrong_logits(input_shape, n_classes):
    return torch.nn.Linear(input_shape[0], 7)


def not_deterministic():
    x = np.random.default_rng().normal(size=(60, 2))
    return x[:40], (x[:40, 0] > 0).astype(int), x[40:], (x[40:, 0] > 0).astype(int)


def three_values(seed):
    return np.zeros((4, 2)), np.zeros(4), np.zeros((2, 2))


# --------------------------------------------------------------------------- what a dataset function gets


def _module(monkeypatch, **fns) -> str:
    mod = types.ModuleType("fake_plugin_mod")
    for name, fn in fns.items():
        setattr(mod, name, fn)
    monkeypatch.setitem(sys.modules, "fake_plugin_mod", mod)
    return "fake_plugin_mod"


def test_a_dataset_function_gets_only_the_keywords_it_declares(monkeypatch, tmp_path):
    seen = {}

    def blobs(seed):
        seen["blobs"] = seed
        return _arrays(seed)

    def on_disk(root, seed=0):
        seen["on_disk"] = (root, seed)
        return _arrays(seed)

    def everything(**kwargs):
        seen["everything"] = kwargs
        return _arrays(0)

    mod = _module(monkeypatch, blobs=blobs, on_disk=on_disk, everything=everything, none=lambda: _arrays(1))
    data.load(config.DataConfig(dataset=f"{mod}:blobs"), 17)
    assert seen["blobs"] == 17
    monkeypatch.chdir(tmp_path)
    data.load(config.DataConfig(dataset=f"{mod}:on_disk", root="data"), 5)
    assert seen["on_disk"] == (str(tmp_path / "data"), 5)  # data.root, absolute
    ds = data.load(config.DataConfig(dataset=f"{mod}:everything"), 3, rank=2, world_size=4)
    assert seen["everything"] == {"seed": 3, "root": None, "rank": 2, "world_size": 4}
    assert not ds.sharded  # **kwargs alone does not make a sharded reader: it must name rank or world_size
    assert data.load(config.DataConfig(dataset=f"{mod}:none"), 0).n_classes == 3  # no keywords at all


def _arrays(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(80, 3)).astype(np.float32)
    y = rng.integers(0, 3, 80)
    return x[:60], y[:60], x[60:], y[60:]


def test_tensors_datasets_and_sharded_readers_of_the_example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import my_data
    finally:
        sys.path.remove(str(EXAMPLE))
    arrays = data.load_user("my_data:blobs", seed=4)
    sets = data.load_user("my_data:blobs_as_datasets", seed=4)
    for a in ("x_train", "y_train", "x_test", "y_test"):  # a torch Dataset is read into the same arrays
        assert np.array_equal(getattr(arrays, a), getattr(sets, a))
    tensors = data.load_user("tests.unit.test_plugins:as_tensors", seed=4)
    assert np.array_equal(tensors.x_train, arrays.x_train) and tensors.y_train.dtype == np.int64
    shard = data.load(config.DataConfig(dataset="my_data:blobs_sharded"), 4, rank=1, world_size=4)
    assert shard.sharded and len(shard.y_train) == 225 and len(shard.y_test) == 300
    raw = my_data.blobs(4)
    assert np.array_equal(shard.x_train, raw[0][1::4])  # a sharded reader's shard is not standardised here
    assert not arrays.sharded


def as_tensors(seed):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import my_data
    finally:
        sys.path.remove(str(EXAMPLE))
    return tuple(torch.as_tensor(a) for a in my_data.blobs(seed))


def test_sharded_statistics_are_the_whole_training_set(monkeypatch):
    """Moments summed over every shard standardise a shard as the whole training set would be."""
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(40, 2, 3)).astype(np.float32)
    whole = data.Dataset(x.copy(), np.zeros(40, np.int64), x[:5].copy(), np.zeros(5, np.int64), "w")
    data.standardize_(whole, x.mean(axis=0, keepdims=True), x.std(axis=0, keepdims=True))
    shard = data.Dataset(x[10:20].copy(), np.zeros(10, np.int64), x[:5].copy(), np.zeros(5, np.int64), "s")
    data.standardize_by_moments_(shard, sum(data.moments(x[i:i + 10]) for i in range(0, 40, 10)))
    assert np.allclose(shard.x_train, whole.x_train[10:20], atol=1e-5)
    assert np.allclose(shard.x_test, whole.x_test, atol=1e-5)


def test_a_torch_dataset_of_images_without_totensor_is_named(monkeypatch):
    class Pictures(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return object(), 0

    mod = _module(monkeypatch, pics=lambda: (Pictures(), Pictures()), one=lambda: (Pictures(), np.zeros(3)))
    with pytest.raises(DataError, match=re.escape("reading the training set failed")):
        data.load_user(f"{mod}:pics")
    with pytest.raises(DataError, match="the test set is ndarray, not a torch Dataset"):
        data.load_user(f"{mod}:one")


def test_a_model_function_is_called_by_keyword_and_checked(monkeypatch):
    calls = []

    def net(n_classes, input_shape):
        calls.append((input_shape, n_classes))
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(input_shape)), n_classes))

    def takes_one(input_shape):
        return torch.nn.Linear(4, 2)

    def not_a_module(input_shape, n_classes):
        return "a string"

    def raises(input_shape, n_classes):
        raise RuntimeError("out of ideas")

    mod = _module(monkeypatch, net=net, takes_one=takes_one, not_a_module=not_a_module, raises=raises)
    m = models.build(config.ModelConfig(name=f"{mod}:net"), (2, 3), 5)
    assert calls == [((2, 3), 5)] and m(torch.zeros(1, 2, 3)).shape == (1, 5)
    with pytest.raises(ModelError, match=re.escape(f"{plugins.MODEL_SIGNATURE}: it does not accept 'n_classes'")):
        models.build(config.ModelConfig(name=f"{mod}:takes_one"), (4,), 2)
    with pytest.raises(ModelError, match="must return a torch.nn.Module"):
        models.build(config.ModelConfig(name=f"{mod}:not_a_module"), (4,), 2)
    with pytest.raises(ModelError, match=re.escape("raises(input_shape=(4,), n_classes=2) raised RuntimeError")):
        models.build(config.ModelConfig(name=f"{mod}:raises"), (4,), 2)


# --------------------------------------------------------------------------- run names, the command line


@pytest.mark.parametrize("overrides, name", [
    ([], "quickstart"),
    (["train.lr=0.1"], "quickstart"),
    (["data.dataset=my_data:blobs"], "quickstart-my_data.blobs"),
    (["data.dataset=my_data:blobs", "model.name=my_data:tiny_mlp"], "quickstart-my_data.blobs-my_data.tiny_mlp"),
    (["data.dataset=digits"], "quickstart"),  # the config's own value: still the config's run
    (["data.dataset=my_data:blobs", "name=mine"], "mine"),
])
def test_a_run_of_other_data_gets_its_own_name(overrides, name):
    assert config.load(ROOT / "configs" / "quickstart.yaml", overrides).name == name


def test_a_config_without_a_name_is_named_after_its_file(tmp_path):
    (tmp_path / "my run.yaml").write_text("seed: 1\n")
    assert config.load(tmp_path / "my run.yaml").name == "my.run"
    assert config.from_dict({}).name == "run"


def test_version_and_help_are_plain(capsys):
    assert cli.main(["--version"]) == 0
    assert re.match(r"communities \d+\.\d+\.\d+ \(torch .+, mpi4py .+, Python .+\)", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--version"])  # argparse's own --version, after the command too
    bench = subprocess.run([sys.executable, "-m", "communities", "bench", "--help"], capture_output=True, text=True)
    top = subprocess.run([sys.executable, "-m", "communities", "--help"], capture_output=True, text=True)
    for text in (bench.stdout, top.stdout):
        assert "SUPPRESS" not in text and "`" not in text and "_profile-rank" not in text


def test_the_mpi_library_string_has_no_nul(monkeypatch):
    from communities.runtime import comm, launcher

    fake = types.SimpleNamespace(Get_library_version=lambda: "Open MPI v5.0.8, package: Open MPI\n ident\0")
    monkeypatch.setattr(launcher, "mpi", lambda: fake)
    assert comm.World.library_version() == "Open MPI v5.0.8, package: Open MPI"


def test_quiet_and_verbose_set_what_is_printed(capsys):
    import logging

    log = logging.getLogger("communities.engine.record.runlog")
    try:
        for quiet, verbose, shown in ((True, False, {"warn"}), (False, False, {"info", "warn"}),
                                      (False, True, {"debug", "info", "warn"})):
            console.configure(quiet, verbose)
            log.debug("debug")
            log.info("info")
            log.warning("warn")
            out, err = capsys.readouterr()
            assert set(out.split()) == shown - {"warn"} and err.split() == ["warn"]  # warnings go to stderr
    finally:
        console.configure()
