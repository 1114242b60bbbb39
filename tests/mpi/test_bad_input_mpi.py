"""Bad input under a real mpiexec: user models that disagree across ranks or return the wrong shape get one
clear message before any rank trains. The single-process checks are in tests/unit/test_bad_input.py."""
import pytest

from tests.helpers.mpi import run_engine


@pytest.mark.timeout(300)
def test_models_that_differ_across_ranks_are_named_at_start(tmp_path, tiny_config):
    res = run_engine(3, tiny_config, tmp_path, "model.name=tests.helpers.user_fns:model_differs_on_rank_1", "name=tiny",
                     check=False)
    assert res.returncode == 2 and "ranks [1] disagree" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_user_model_with_wrong_output_shape(tmp_path, tiny_config):
    res = run_engine(2, tiny_config, tmp_path, "model.name=tests.helpers.user_fns:wrong_logits", check=False)
    assert res.returncode == 2 and "returns shape" in res.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fn, needle", [("fails_on_rank_1", "rank 1: data.dataset="),
                                        ("strings", "y_train holds <U1 values")])
def test_a_user_dataset_that_raises_or_returns_strings_is_one_clean_error(tmp_path, tiny_config, fn, needle):
    res = run_engine(3, tiny_config, tmp_path, f"data.dataset=tests.helpers.user_fns:{fn}", "data.partition=iid",
                     "name=tiny", check=False, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("communities: error:") == 1 and "Traceback" not in res.stderr
    assert needle in res.stderr and f"{fn}" in res.stderr
    if fn == "fails_on_rank_1":
        assert "fails_on_rank_1() raised RuntimeError: injected failure on rank 1" in res.stderr
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()
