"""Bad input under a real mpiexec: user models that disagree across ranks or return the wrong shape get one
clear message before any rank trains. The single-process checks are in tests/unit/test_bad_input.py.

The four refused runs share one batch (tests/helpers/batch.py): three processes start once, and each run goes
through ``communities run``'s own entry as its own job, its exit code the highest over the ranks."""
import pytest

from tests.helpers.mpi import tiny_batch

pytestmark = pytest.mark.timeout(600)

USER = "tests.helpers.user_fns"
DATASETS = {"fails_on_rank_1": "rank 1: data.dataset=", "strings": "y_train holds <U1 values"}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Each bad input's run of the tiny config on 3 ranks: (its result, its run directory)."""
    jobs = {"differs": ["name=tiny", f"model.name={USER}:model_differs_on_rank_1"],
            "wrong_logits": [f"model.name={USER}:wrong_logits"],
            **{fn: [f"data.dataset={USER}:{fn}", "data.partition=iid", "name=tiny"] for fn in DATASETS}}
    runs = tiny_batch(tmp_path_factory, "bad_input", 3, jobs, timeout=480, check=False)
    return {name: (runs.result[name], runs[name]) for name in jobs}


def test_models_that_differ_across_ranks_are_named_at_start(refused):
    res, run = refused["differs"]
    assert res.returncode == 2 and "ranks [1] disagree" in res.stderr and "Traceback" not in res.stderr
    assert not (run / "metrics.jsonl").exists()


def test_user_model_with_wrong_output_shape(refused):
    res, _ = refused["wrong_logits"]
    assert res.returncode == 2 and "returns shape" in res.stderr


@pytest.mark.parametrize("fn, needle", sorted(DATASETS.items()))
def test_a_user_dataset_that_raises_or_returns_strings_is_one_clean_error(refused, fn, needle):
    res, run = refused[fn]
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("communities: error:") == 1 and "Traceback" not in res.stderr
    assert needle in res.stderr and f"{fn}" in res.stderr
    if fn == "fails_on_rank_1":
        assert "fails_on_rank_1() raised RuntimeError: injected failure on rank 1" in res.stderr
    assert not (run / "metrics.jsonl").exists()
