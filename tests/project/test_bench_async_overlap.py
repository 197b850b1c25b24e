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
    # A synchronous step's interval holds its whole forward (and its bookkeeping).
    assert result["step_interval_ms_sync"] > result["forward_ms_sync"]
    share = 1 - result["exposed_ms_async"] / result["exposed_ms_sync"]
    assert math.isclose(result["hidden_share"], share, abs_tol=2e-3)
