"""``tokenwire bench overhead --compare-async``: both variants run on the tiny model, the step
interval is measured from consecutive full decode steps, and the share is computed from them."""

from __future__ import annotations

import math

from tokenwire.bench.async_overlap import async_overlap
from tokenwire.bench.configs import OverheadConfig
from tokenwire.runtime.engine_args import EngineArgs


def test_compare_async_reports_both_variants_and_the_share() -> None:
    config = OverheadConfig(engine=EngineArgs(max_num_seqs=4), num_seqs=4, output_len=12)
    result = async_overlap(config, rounds=1)
    assert result["bench"] == "overhead_async" and result["num_seqs"] == 4
    for key in ("step_interval_ms_sync", "step_interval_ms_async", "forward_ms_sync"):
        assert result[key] > 0
    # What is exposed is the interval less the forward and sampling (medians of each: on a
    # loaded box the median interval need not exceed the median forward, so no order is
    # asserted between those two).
    for mode in ("sync", "async"):
        left = result[f"step_interval_ms_{mode}"] - result[f"forward_ms_{mode}"]
        assert result[f"exposed_ms_{mode}"] <= left + 2e-3
    share = 1 - result["exposed_ms_async"] / result["exposed_ms_sync"]
    assert math.isclose(result["hidden_share"], share, abs_tol=2e-3)
