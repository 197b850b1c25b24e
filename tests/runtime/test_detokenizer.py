"""Incremental detokenizer: deltas concatenate to the full decode; stop strings; special tokens.

Uses the default model's tokenizer (SmolLM2, byte-level BPE: multi-byte characters and emoji
split across tokens), plus a tiny sentencepiece-style (Metaspace) tokenizer built in the test
for the leading-space rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tokenwire.runtime.front.detokenizer import (
    IncrementalDetokenizer,
    decode_token,
    find_earliest_stop,
    stop_prefix_len,
)
from tokenwire.runtime.sampling_params import SamplingParams

FFFD = "\ufffd"
# SmolLM2 (vocab 49152): ids 0..16 are special tokens, ids 17..272 the 256 single-byte tokens.
TOKEN_IDS = st.one_of(st.integers(0, 16), st.integers(17, 272), st.integers(0, 49151))
# Text mixing ASCII, accents, CJK and emoji (4-byte UTF-8, split across byte-level tokens).
ALPHABET = "ab xyz.\n" + "éüß" + "中文日本語" + "😀🎉👍🏽"
HYPO = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Split ids into consecutive chunks whose sizes cycle through ``sizes``."""
    out, i = [], 0
    while i < len(ids):
        size = sizes[len(out) % len(sizes)]
        out.append(list(ids[i : i + size]))
        i += size
    return out


def run(
    tok: Any,
    ids: Sequence[int],
    params: SamplingParams,
    prompt: Sequence[int] = (),
    sizes: Sequence[int] = (1,),
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Stream ids in chunks; return (update deltas, flush delta, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas = [detok.update(chunk) for chunk in chunked(ids, sizes)]
    return deltas, detok.flush(), detok


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- round trip, no stop strings


@HYPO
@given(
    prompt=st.lists(TOKEN_IDS, max_size=8),
    ids=st.lists(TOKEN_IDS, min_size=1, max_size=16),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_random_ids_concatenate_to_full_decode(
    smollm_tokenizer: Any, prompt: list[int], ids: list[int], sizes: list[int], skip: bool
) -> None:
    deltas, tail, detok = run(
        smollm_tokenizer, ids, SamplingParams(skip_special_tokens=skip), prompt, sizes
    )
    full = smollm_tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == detok.output_text == full
    assert detok.stop_matched is None and detok.num_output_tokens == len(ids)
    if FFFD not in full:
        assert all(FFFD not in d for d in [*deltas, tail])


@HYPO
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=24), skip=st.booleans())
def test_real_text_token_by_token_releases_each_complete_character(
    smollm_tokenizer: Any, text: str, skip: bool
) -> None:
    tok = smollm_tokenizer
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(
        tok, encode(tok, "Say:"), SamplingParams(skip_special_tokens=skip)
    )
    complete = ""
    for k, token_id in enumerate(ids, start=1):
        delta = detok.update([token_id])
        assert FFFD not in delta
        so_far = tok.decode(ids[:k], skip_special_tokens=skip)
        if not so_far.endswith(FFFD):
            complete = so_far
        # Liveness: with no stop strings, text is released by the token that completes it.
        assert detok.output_text == complete
    assert detok.flush() == ""
    assert detok.output_text == text


@HYPO
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_real_text_in_random_chunks(smollm_tokenizer: Any, text: str, sizes: list[int]) -> None:
    ids = encode(smollm_tokenizer, text)
    deltas, tail, detok = run(smollm_tokenizer, ids, SamplingParams(), sizes=sizes)
    assert "".join(deltas) + tail == text == detok.output_text
    assert all(FFFD not in d for d in deltas)


def test_generation_cut_mid_character_flushes_replacement_char(smollm_tokenizer: Any) -> None:
    ids = encode(smollm_tokenizer, "hi 😀")[:-1]  # the emoji's last byte never arrives
    deltas, tail, detok = run(smollm_tokenizer, ids, SamplingParams())
    assert "".join(deltas) == "hi"
    assert tail == " " + FFFD
    assert detok.output_text == smollm_tokenizer.decode(ids)


# ---------------------------------------------------------------- stop strings


def stream_text(
    tok: Any, text: str, sizes: Sequence[int] = (1,), **params: Any
) -> tuple[list[str], str, IncrementalDetokenizer]:
    return run(tok, encode(tok, text), SamplingParams(**params), sizes=sizes)


def test_stop_inside_one_token(smollm_tokenizer: Any) -> None:
    deltas, tail, detok = stream_text(
        smollm_tokenizer, "Hello world, this is a test.", stop=["orl"]
    )
    assert detok.stop_matched == "orl"
    assert detok.output_text == "Hello w" == "".join(deltas) + tail
    assert detok.num_output_tokens == 2  # "Hello", " world"


@pytest.mark.parametrize("stop", ["lo wo", "hello world n"])
def test_stop_across_token_boundaries(smollm_tokenizer: Any, stop: str) -> None:
    text = "say hello world now"
    ids = encode(smollm_tokenizer, text)
    assert all(stop not in decode_token(smollm_tokenizer, i) for i in ids)  # really split
    deltas, _, detok = stream_text(smollm_tokenizer, text, stop=[stop])
    assert detok.stop_matched == stop
    assert detok.output_text == text[: text.index(stop)] == "".join(deltas)


def test_stop_with_multibyte_characters(smollm_tokenizer: Any) -> None:
    text = "我喜欢中文和日本语"
    for stop in ("文和日", "日本", "欢"):
        deltas, _, detok = stream_text(smollm_tokenizer, text, stop=[stop])
        assert detok.stop_matched == stop
        assert detok.output_text == text[: text.index(stop)] == "".join(deltas)
        assert all(FFFD not in d for d in deltas)


def test_same_token_completes_two_stops_earliest_start_wins(smollm_tokenizer: Any) -> None:
    # Both complete at token " world"; "lo w" would complete first by character count.
    for sizes in ((1,), (4,)):
        _, _, detok = stream_text(
            smollm_tokenizer, "say hello world now", sizes, stop=["lo w", "hello world"]
        )
        assert detok.stop_matched == "hello world"
        assert detok.output_text == "say "


def test_first_completed_stop_wins_however_updates_are_chunked(smollm_tokenizer: Any) -> None:
    # "world" completes at token 3, before the earlier-starting "hello world now" (token 4).
    for sizes in ((1,), (2,), (4,), (3, 1)):
        _, _, detok = stream_text(
            smollm_tokenizer, "say hello world now", sizes, stop=["hello world now", "world"]
        )
        assert detok.stop_matched == "world"
        assert detok.output_text == "say hello "
        assert detok.num_output_tokens == 3


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(smollm_tokenizer: Any, include: bool) -> None:
    deltas, tail, detok = stream_text(
        smollm_tokenizer,
        "The capital of France is Paris.",
        stop=["France"],
        include_stop_str_in_output=include,
    )
    expected = "The capital of France" if include else "The capital of "
    assert detok.output_text == expected == "".join(deltas) + tail
    assert detok.stop_matched == "France"


def test_stop_at_very_start_of_output(smollm_tokenizer: Any) -> None:
    deltas, tail, detok = stream_text(smollm_tokenizer, "stop here and stop there", stop=["stop"])
    assert detok.stop_matched == "stop"
    assert detok.output_text == "" and tail == ""
    assert all(d == "" for d in deltas)
    assert detok.update(encode(smollm_tokenizer, " more")) == ""  # nothing after a match
    assert detok.num_output_tokens == 1


def test_held_stop_prefix_released_when_broken_or_by_flush(smollm_tokenizer: Any) -> None:
    deltas, tail, detok = stream_text(smollm_tokenizer, "say hello world", stop=["world peace"])
    assert deltas == ["say", " hello", " "] and tail == "world"  # "world" may begin the stop
    assert detok.output_text == "say hello world" and detok.stop_matched is None
    deltas, tail, _ = stream_text(smollm_tokenizer, "say hello world now", stop=["world peace"])
    # " now" breaks the held "world", but its last "w" may begin the stop again.
    assert deltas == ["say", " hello", " ", "world no"] and tail == "w"


def test_min_tokens_ignores_stops_in_first_tokens(smollm_tokenizer: Any) -> None:
    text = "stop here and stop there"  # tokens: stop| here| and| stop| there
    _, _, detok = stream_text(smollm_tokenizer, text, stop=["stop"], min_tokens=2)
    assert detok.stop_matched == "stop"
    assert detok.output_text == "stop here and "
    # The second "stop" completes at token 4: honoured iff min_tokens < 4 (vLLM's rule).
    _, _, detok = stream_text(smollm_tokenizer, text, stop=["stop"], min_tokens=3)
    assert detok.output_text == "stop here and "
    _, tail, detok = stream_text(smollm_tokenizer, text, stop=["stop"], min_tokens=4)
    assert detok.stop_matched is None and detok.output_text == text
    assert tail == ""  # "there" does not begin "stop": nothing was held
    # A stop starting in token 2's text and ending in token 3's counts when min_tokens is 2.
    _, _, detok = stream_text(smollm_tokenizer, "say hello world now", stop=["lo wo"], min_tokens=2)
    assert detok.stop_matched == "lo wo"
    assert detok.output_text == "say hel"


@HYPO
@given(
    text=st.text(alphabet="ab é中😀", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab é中😀", min_size=1, max_size=4), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    include=st.booleans(),
    min_tokens=st.integers(0, 3),
)
def test_stop_strings_properties(
    smollm_tokenizer: Any,
    text: str,
    stops: list[str],
    sizes: list[int],
    include: bool,
    min_tokens: int,
) -> None:
    params = dict(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    one = stream_text(smollm_tokenizer, text, (1,), **params)
    many = stream_text(smollm_tokenizer, text, sizes, **params)
    for deltas, tail, detok in (one, many):
        assert "".join(deltas) + tail == detok.output_text
    # Chunking of updates never changes the result.
    assert (one[2].output_text, one[2].stop_matched) == (many[2].output_text, many[2].stop_matched)
    out, matched = one[2].output_text, one[2].stop_matched
    if matched is None:
        assert out == text
        if min_tokens == 0:
            assert not any(s in text for s in stops)
    else:
        kept = out if include else out + matched
        assert text.startswith(kept) and kept.endswith(matched)
        if min_tokens == 0 and not include:
            assert not any(s in out for s in stops)  # the first stop to appear ends the text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    new_chars=st.integers(0, 12),
)
def test_stop_helpers_match_brute_force(text: str, stops: list[str], new_chars: int) -> None:
    new_chars = min(new_chars, len(text))
    old = len(text) - new_chars
    ends_in_new = [(i, s) for s in stops for i in range(old + 1 - len(s), len(text))]
    matches = [(i, s) for i, s in ends_in_new if i >= 0 and text.startswith(s, i)]
    expected = min(matches, key=lambda m: (m[0], len(m[1])), default=None)
    assert find_earliest_stop(text, new_chars, stops) == expected
    suffixes = [text[len(text) - n :] for n in range(len(text) + 1)]
    may_begin = [
        len(x) for x in suffixes if any(len(s) > len(x) and s.startswith(x) for s in stops)
    ]
    assert stop_prefix_len(text, stops) == max(may_begin)


# ---------------------------------------------------------------- special tokens, spaces


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(smollm_tokenizer: Any, skip: bool) -> None:
    tok = smollm_tokenizer
    ids = [*encode(tok, "Hi"), 2, *encode(tok, " there"), 0]  # <|im_end|>, <|endoftext|>
    deltas, tail, detok = run(tok, ids, SamplingParams(skip_special_tokens=skip))
    expected = "Hi there" if skip else "Hi<|im_end|> there<|endoftext|>"
    assert "".join(deltas) + tail == detok.output_text == expected
    assert expected == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_matches_special_token_text_only_when_kept(smollm_tokenizer: Any) -> None:
    ids = [*encode(smollm_tokenizer, "Hi"), 2, *encode(smollm_tokenizer, " there")]
    kept = run(
        smollm_tokenizer, ids, SamplingParams(stop=["<|im_end|>"], skip_special_tokens=False)
    )
    assert kept[2].stop_matched == "<|im_end|>" and kept[2].output_text == "Hi"
    skipped = run(smollm_tokenizer, ids, SamplingParams(stop=["<|im_end|>"]))
    assert skipped[2].stop_matched is None and skipped[2].output_text == "Hi there"


@pytest.mark.parametrize("answer", [" The capital", "The capital"])
@pytest.mark.parametrize("skip", [True, False])
def test_first_token_after_chat_prompt(smollm_tokenizer: Any, answer: str, skip: bool) -> None:
    tok = smollm_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = encode(tok, prompt)
    ids = encode(tok, answer)
    deltas, tail, detok = run(tok, ids, SamplingParams(skip_special_tokens=skip), prompt_ids)
    # Byte-level BPE keeps a leading space even at the start of a decode: no difference.
    assert deltas[0] == decode_token(tok, ids[0]) == answer[: len(deltas[0])]
    assert deltas[0].strip() == "The" and tail == ""
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip) == answer


def metaspace_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_sentencepiece_first_token_keeps_space_in_context() -> None:
    tok = metaspace_tokenizer()
    assert tok.decode([2]) == "world"  # a decode drops the first token's leading space
    _, _, in_context = run(tok, [2, 3], SamplingParams(), prompt=[1])
    assert in_context.output_text == " world!"  # as it reads after the prompt (vLLM)
    _, _, no_prompt = run(tok, [2, 3], SamplingParams(), prompt=[])
    assert no_prompt.output_text == "world!" == tok.decode([2, 3])


def test_prompt_ending_mid_character_decodes_output_on_its_own(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    emoji = encode(tok, "hi 😀")  # the emoji's bytes span the last two tokens
    prompt, ids = emoji[:-1], [*emoji[-1:], *encode(tok, " ok")]
    deltas, tail, detok = run(tok, ids, SamplingParams(), prompt)
    # The output's first byte completes a character of the prompt; the output alone decodes
    # that byte as U+FFFD, and so does the detokenizer (it never "repairs" the prompt's text).
    assert detok.output_text == tok.decode(ids) == FFFD + " ok"
    assert "".join(deltas) + tail == detok.output_text


def test_decode_token_for_logprobs(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    assert decode_token(tok, encode(tok, " world")[0]) == " world"
    assert decode_token(tok, 2) == "<|im_end|>"  # special tokens shown, as vLLM does
    assert decode_token(tok, encode(tok, "😀")[0]) == FFFD  # partial character
