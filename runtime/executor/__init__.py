"""Executors: the engine core's handle on its workers (the model on one device, or a
tensor-parallel group of worker processes). The workers themselves are ``runtime/worker/``."""
