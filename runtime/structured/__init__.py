"""Constrained decoding (structured outputs) with xgrammar: params, compile pool, matchers,
bitmasks."""
