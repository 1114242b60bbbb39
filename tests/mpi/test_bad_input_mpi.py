"""Bad input under a real mpiexec: user models that disagree across ranks or return the wrong shape get one
clear message before any rank trains. The single-process checks are in tests/unit/test_bad_input.py."""
import pytest

from tests.helpers.mpi import run_engine


@pytest.mark.timeout(300)
def test_models_that_differ_across_ranks_are_named_at_start(tmp_path, tiny_config):
    res = run_engine(3, tiny_config, tmp_path, "model.name=tests.helpers.user_fns:model_differs_on_rank_1", check=False)
    assert res.returncode == 2 and "ranks [1] disagree" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_user_model_with_wrong_output_shape(tmp_path, tiny_config):
    res = run_engine(2, tiny_config, tmp_path, "model.name=tests.helpers.user_fns:wrong_logits", check=False)
    assert res.returncode == 2 and "returns shape" in res.stderr
