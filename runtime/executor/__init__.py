"""Executors: what runs the model under the engine core, on one device or on a
tensor-parallel group of worker processes."""
