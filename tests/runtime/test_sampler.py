"""Batched sampler: greedy, raw logprobs, seeded batch invariance, filters, bias, penalties."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenwire.runtime.sample.sampler import (
    Sampler,
    SamplerOutput,
    apply_logits_processors,
    apply_top_k_top_p,
)
from tokenwire.runtime.sample.sampling_metadata import (
    RowSamplingState,
    SamplingMetadata,
    build_sampling_metadata,
    token_counts,
)
from tokenwire.runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])


def make_row(
    params: SamplingParams,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    stops: frozenset[int] = frozenset(),
    device: str = "cpu",
) -> RowSamplingState:
    """A row whose generator (if seeded) is fresh, as the runner creates it for a new request."""
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=device).manual_seed(params.seed)
    return RowSamplingState(params, gen, prompt, output, stops)


def meta_for(rows: Sequence[RowSamplingState], vocab: int) -> SamplingMetadata:
    return build_sampling_metadata(rows, vocab, CPU)


def sample(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> SamplerOutput:
    meta = build_sampling_metadata(rows, logits.shape[1], logits.device)
    return Sampler()(logits, meta)


def random_logits(b: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def repeated(probs: Sequence[float], b: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(b, -1).contiguous()


def frequencies(tokens: torch.Tensor, v: int) -> list[float]:
    return (torch.bincount(tokens, minlength=v).float() / tokens.numel()).tolist()


def test_all_greedy_metadata_skips_every_optional_stage() -> None:
    rows = [make_row(GREEDY, prompt=[1, 2], output=[3]) for _ in range(4)]
    meta = meta_for(rows, 50)
    assert meta.all_greedy and not meta.all_random
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.penalties is None and meta.logit_bias is None and meta.min_tokens_mask is None
    assert meta.max_num_logprobs is None and meta.generators == {}


def test_builder_normalises_filters_and_generators() -> None:
    rows = [
        make_row(SamplingParams(top_k=500, top_p=0.5, seed=3)),
        make_row(SamplingParams(temperature=0.0, top_k=2, seed=4)),  # greedy: filters ignored
        make_row(SamplingParams(top_k=3, min_p=0.1, logprobs=2)),
    ]
    meta = meta_for(rows, 10)
    assert meta.top_k is not None and meta.top_k.tolist() == [10, 10, 3]
    assert meta.top_p is not None and meta.top_p.tolist() == [0.5, 1.0, 1.0]
    assert meta.min_p is not None and meta.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert list(meta.generators) == [0]  # the greedy seeded row never draws
    assert meta.temperature.tolist() == [1.0, 1.0, 1.0]
    assert meta.max_num_logprobs == 2 and meta.num_logprobs == (None, None, 2)


def test_builder_requires_generator_iff_seed() -> None:
    with pytest.raises(ValueError, match="generator"):
        meta_for([RowSamplingState(SamplingParams(seed=1), None, [], [])], 8)
    with pytest.raises(ValueError, match="generator"):
        meta_for([RowSamplingState(SamplingParams(), torch.Generator(), [], [])], 8)


def test_token_counts_scatter_padded_rows() -> None:
    counts = token_counts([[1, 1, 3], [], [4]], 5, CPU)
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


def test_greedy_equals_argmax_first_max_on_ties() -> None:
    logits = random_logits(8, 100, seed=0)
    logits[3] = 0.0
    logits[3, 7] = logits[3, 42] = 5.0  # tie: torch.argmax / HF take the first
    out = sample(logits, [make_row(GREEDY) for _ in range(8)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3].item() == 7
    assert out.logprobs is None


def test_logprobs_are_raw_and_unaffected_by_processing() -> None:
    torch.manual_seed(0)  # row 0 samples from the global stream: not from whatever ran before
    v = 40
    logits = random_logits(5, v, seed=1)
    original = logits.clone()
    params = [
        SamplingParams(temperature=0.7, logprobs=5, logit_bias={3: 10.0}),
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=1.3, top_k=4, frequency_penalty=0.5, seed=9, logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, min_p=0.2, logprobs=0),
    ]
    rows = [make_row(p, prompt=[1, 2, 3], output=[3, 4, 4]) for p in params]
    out = sample(logits, rows)
    assert torch.equal(logits, original)  # the sampler never writes its input
    assert out.logprobs is not None
    lp = out.logprobs
    assert lp.token_ids.shape == (5, 6) and lp.logprobs.shape == (5, 6)
    raw = torch.log_softmax(original, dim=-1)
    sampled = out.sampled_token_ids
    sampled_raw = raw.gather(1, sampled[:, None])
    top_lp, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(lp.token_ids, torch.cat([sampled[:, None], top_ids], dim=1))
    expected = torch.cat([sampled_raw, top_lp], dim=1)
    torch.testing.assert_close(lp.logprobs, expected, atol=1e-6, rtol=0)
    # Distinct random logits: rank = 1 + number of strictly better tokens.
    assert torch.equal(lp.ranks, (raw > sampled_raw).sum(dim=-1) + 1)
    assert sampled[0].item() == 3  # row 0's bias moved its pick; the report stays raw


def test_logprobs_zero_gives_only_the_sampled_column() -> None:
    logits = random_logits(2, 30, seed=2)
    out = sample(logits, [make_row(SamplingParams(temperature=0.0, logprobs=0))] * 2)
    assert out.logprobs is not None
    assert out.logprobs.token_ids.shape == (2, 1)
    assert out.logprobs.ranks.tolist() == [1, 1]  # greedy picks the top token


TARGETS = [
    SamplingParams(temperature=0.9, seed=1234),
    SamplingParams(temperature=1.2, seed=77, top_k=20, top_p=0.9, min_p=0.02),
]


def target_logits(step: int, v: int) -> torch.Tensor:
    return random_logits(1, v, seed=1000 + step, scale=1.0)[0]


def other_rows(b: int, device: str) -> list[RowSamplingState]:
    """A mix of everything: other seeds, unseeded, greedy, filters, penalties, bias, logprobs."""
    kinds = [
        SamplingParams(seed=5),
        SamplingParams(temperature=0.7),
        GREEDY,
        SamplingParams(top_k=3, seed=6),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3, repetition_penalty=1.4, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={2: 5.0}, logprobs=4),
        SamplingParams(min_tokens=4, top_k=8, logprobs=1),
    ]
    stops = frozenset({0})
    kinds = [kinds[i % len(kinds)] for i in range(b)]
    return [make_row(p, prompt=[1, 2, 9], output=[2, 2], stops=stops, device=device) for p in kinds]


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("position", [0, 7, 15])
def test_seeded_row_is_batch_invariant(target: SamplingParams, position: int, device: str) -> None:
    v, steps, b = 64, 20, 16
    alone_row = make_row(target, device=device)
    alone = []
    for t in range(steps):
        logits = target_logits(t, v)[None].to(device)
        alone.append(int(sample(logits, [alone_row]).sampled_token_ids[0]))
    rows = other_rows(b, device)
    rows[position] = make_row(target, device=device)  # fresh generator with the same seed
    batched = []
    for t in range(steps):
        logits = random_logits(b, v, seed=t)
        logits[position] = target_logits(t, v)
        batched.append(int(sample(logits.to(device), rows).sampled_token_ids[position]))
    assert batched == alone
    assert len(set(alone)) > 3  # the stream really is random, not a constant pick


PROBS = [0.1, 0.2, 0.3, 0.4]


# (temperature, seeded, expected frequencies); temperature 0.5 squares the probabilities.
FREQUENCY_CASES = [
    (1.0, False, PROBS),
    (1.0, True, PROBS),
    (0.5, False, [p * p / sum(q * q for q in PROBS) for p in PROBS]),
]


@pytest.mark.parametrize(("temperature", "seeded", "expected"), FREQUENCY_CASES)
def test_sampling_frequencies_match_probabilities(
    temperature: float, seeded: bool, expected: list[float]
) -> None:
    torch.manual_seed(0)
    n = 4000
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None) for i in range(n)]
    out = sample(repeated(PROBS, n), [make_row(p) for p in params])
    assert frequencies(out.sampled_token_ids, 4) == pytest.approx(expected, abs=0.03)


# top_p = 1e-9: 1 - p rounds to 1.0 in float32, so only the keep-the-top rule saves the row.
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=2.0, top_k=1), *(SamplingParams(top_p=p) for p in (1e-3, 1e-9))],
)
def test_single_token_filters_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(16, 50, seed=3, scale=0.5)
    rows = [make_row(params.with_seed(i)) for i in range(16)]
    assert torch.equal(sample(logits, rows).sampled_token_ids, logits.argmax(dim=-1))


SKEWED = [0.05, 0.5, 0.15, 0.3]  # top two (tokens 1 and 3) hold 0.8


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_p=0.7), {1, 3}),  # 0.5 < 0.7 <= 0.8
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(min_p=0.5), {1, 3}),  # threshold 0.25
        (SamplingParams(min_p=0.2), {1, 2, 3}),  # threshold 0.1
        (SamplingParams(top_k=3, top_p=0.9), {1, 2, 3}),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(params: SamplingParams, kept: set[int]) -> None:
    torch.manual_seed(2)
    n = 3000
    freq = frequencies(sample(repeated(SKEWED, n), [make_row(params)] * n).sampled_token_ids, 4)
    total = sum(SKEWED[t] for t in kept)
    expected = [SKEWED[t] / total if t in kept else 0.0 for t in range(4)]
    assert freq == pytest.approx(expected, abs=0.03)
    assert all(freq[t] == 0.0 for t in range(4) if t not in kept)


def test_neutral_top_k_top_p_rows_are_bit_identical() -> None:
    logits = random_logits(3, 20, seed=5)
    logits[1, :5] = float("-inf")  # zero-probability tokens survive a p = 1 row untouched
    top_k = torch.tensor([20, 20, 2])
    top_p = torch.tensor([1.0, 1.0, 0.99])
    out = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(out[:2], logits[:2])
    assert torch.isfinite(out[2]).sum().item() == 2


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isfinite(out[0]).tolist() == [False, True, True, True, False]


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = random_logits(3, 30, seed=6)
    top = logits.argmax(dim=-1)
    low = logits.argmin(dim=-1)
    rows = [
        make_row(SamplingParams(temperature=0.0, logit_bias={int(low[0]): 100.0})),
        make_row(SamplingParams(temperature=1.0, logit_bias={int(low[1]): 100.0}, seed=3)),
        make_row(SamplingParams(temperature=0.0, logit_bias={int(top[2]): -100.0})),
    ]
    sampled = sample(logits, rows).sampled_token_ids
    second = logits[2].topk(2).indices[1]
    assert sampled.tolist() == [int(low[0]), int(low[1]), int(second)]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 5] = 9.0  # EOS
    logits[0, 7] = 8.0  # stop token id
    logits[0, 2] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    stops = frozenset({5, 7})
    short = sample(logits, [make_row(params, output=[1, 1], stops=stops)])
    done = sample(logits, [make_row(params, output=[1, 1, 1], stops=stops)])
    assert short.sampled_token_ids.item() == 2
    assert done.sampled_token_ids.item() == 5
    # Random rows too: 500 draws from a distribution dominated by the masked ids.
    torch.manual_seed(3)
    random_row = make_row(SamplingParams(min_tokens=3), stops=stops)
    many = sample(logits.expand(500, -1).contiguous(), [random_row] * 500)
    assert not torch.isin(many.sampled_token_ids, torch.tensor([5, 7])).any()


LOGITS_6 = [2.0, -1.0, 0.5, 3.0, -2.0, 0.8]
# prompt [0, 1]; output [3, 3, 4]: repetition hits {0, 1, 3, 4}; counts: 3 -> 2, 4 -> 1.
PENALTY_CASES = [
    (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -4.0, 0.8]),
    (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, 0.5, 2.0, -2.5, 0.8]),
    (SamplingParams(presence_penalty=0.25), [2.0, -1.0, 0.5, 2.75, -2.25, 0.8]),
    (
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        [1.0, -2.0, 0.5, 0.25, -4.75, 0.8],
    ),
]


@pytest.mark.parametrize(("params", "expected"), PENALTY_CASES)
def test_penalties_match_hand_computation(params: SamplingParams, expected: list[float]) -> None:
    logits = torch.tensor([LOGITS_6, LOGITS_6])
    original = logits.clone()
    rows = [
        make_row(params, prompt=[0, 1], output=[3, 3, 4]),
        make_row(SamplingParams(), prompt=[0, 1], output=[3, 3, 4]),  # neutral row: untouched
    ]
    out = apply_logits_processors(logits, meta_for(rows, 6))
    torch.testing.assert_close(out[0], torch.tensor(expected), atol=1e-6, rtol=0)
    assert torch.equal(out[1], logits[1])
    assert torch.equal(logits, original)  # input not modified


def test_penalties_change_the_greedy_pick() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5)
    picked = sample(torch.tensor([LOGITS_6]), [make_row(params, prompt=[0, 1], output=[3, 3, 4])])
    assert picked.sampled_token_ids.item() == 0  # token 3 fell from 3.0 to 0.5


def test_mixed_batch_rows_match_running_alone() -> None:
    v, b = 48, 6
    params = [
        SamplingParams(temperature=0.0, logit_bias={4: 2.0}),
        SamplingParams(top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8, seed=11, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, logprobs=2),
        SamplingParams(temperature=1.1, min_p=0.05, presence_penalty=0.5, min_tokens=3, seed=12),
        SamplingParams(logprobs=1),
    ]
    stops = frozenset({0, 1})
    batch_rows = [make_row(p, prompt=[1, 4, 9], output=[4, 7], stops=stops) for p in params]
    alone_rows = [make_row(p, prompt=[1, 4, 9], output=[4, 7], stops=stops) for p in params]
    for step in range(5):
        logits = random_logits(b, v, seed=100 + step)
        batch = sample(logits, batch_rows)
        assert batch.logprobs is not None and batch.logprobs.token_ids.shape == (b, 4)
        for i in (0, 2, 3, 4):  # greedy and seeded rows are deterministic
            alone = sample(logits[i : i + 1], [alone_rows[i]])
            assert alone.sampled_token_ids.item() == batch.sampled_token_ids[i].item()
            k = params[i].logprobs
            if k is not None:
                solo, batched = alone.logprobs, batch.logprobs
                assert solo is not None
                assert torch.equal(solo.token_ids[0], batched.token_ids[i, : 1 + k])
                assert torch.equal(solo.logprobs[0], batched.logprobs[i, : 1 + k])
                assert solo.ranks[0] == batched.ranks[i]
        # The unseeded top-k row stays inside its top 5.
        assert batch.sampled_token_ids[1] in logits[1].topk(5).indices
        # Row 4 is under min_tokens (2 < 3 outputs): its stop ids 0 and 1 are never picked.
        assert batch.sampled_token_ids[4].item() not in (0, 1)


def test_rejects_logits_of_the_wrong_shape() -> None:
    meta = meta_for([make_row(GREEDY)], 10)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 10), meta)
    assert Sampler()(torch.zeros(1, 10), meta).sampled_token_ids.tolist() == [0]
