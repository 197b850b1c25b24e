"""Quantized linear layers: one ``LinearMethod`` per weight scheme (see ``base``)."""
