"""`AvgAtKCallback` on two gloo processes (`torch.distributed.run --nproc_per_node 2`, CPU) against one: each process
generates only its share of the held-out problems, the figure is exactly the one-process figure, and another
callback's `on_log` (what every `report_to` integration implements) receives it on every process. The model is the
shared quick demo's warm start (conftest's `quick_demo`), which solves some but not all of its held-out problems."""

import json
from pathlib import Path

import pytest
from launching import launcher, run_launched


pytestmark = pytest.mark.slow  # launches processes that train

WORKER = Path(__file__).resolve().parent / "avg_at_k_worker.py"
FIGURES = ("heldout/avg@4", "heldout/pass@1", "heldout/pass@4")


@pytest.fixture(scope="module")
def runs(quick_demo, tmp_path_factory):
    """{processes: each rank's record} of the worker on 1 and on 2 processes."""
    runs = {}
    for n in (1, 2):
        out = tmp_path_factory.mktemp(f"avg-at-k-{n}proc")
        run_launched(
            [*launcher(n), WORKER, quick_demo.out / "lm" / "start-model", quick_demo.out / "heldout.jsonl", out]
        )
        runs[n] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(n)]
    return runs


def test_each_process_generates_only_its_share(runs):
    (one,), two = runs[1], runs[2]
    assert [r["world_size"] for r in two] == [2, 2] and one["world_size"] == 1
    # 30 problems x 4 samples, at most 16 sequences per chunk: 8 chunks of 4 problems (the last one of 2)
    assert one["chunks"] == [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]
    assert one["shares"] == [list(range(30))] * 2  # on start and after the step
    for evaluation in range(2):
        shares = [r["shares"][evaluation] for r in two]
        assert shares == [list(range(16)), list(range(16, 30))]  # split_between_processes over the chunks


def test_the_figure_is_the_one_process_figure(runs):
    (one,), two = runs[1], runs[2]
    start = {name: one["history"][0][name] for name in FIGURES}
    assert one["history"][0]["step"] == 0
    for rank in two:  # same weights at step 0: the same figures, bit for bit, on every process
        assert {name: rank["history"][0][name] for name in FIGURES} == start
        assert rank["history"][0]["step"] == 0 and [h["step"] for h in rank["history"]] == [0, 1]
    assert two[0]["history"][1] | {"heldout/eval_seconds": 0} == two[1]["history"][1] | {"heldout/eval_seconds": 0}
    assert 0 < start["heldout/avg@4"] < 1 and start["heldout/avg@4"] <= start["heldout/pass@4"]  # not trivial


def test_other_callbacks_receive_it_through_the_trainer(runs):
    for rank in [*runs[1], *runs[2]]:
        received = [{name: log[name] for name in FIGURES} for log in rank["on_log"]]
        assert received == [{name: h[name] for name in FIGURES} for h in rank["history"]]
        assert [log["step"] for log in rank["on_log"]] == [0, 1]
