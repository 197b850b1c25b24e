"""Multi-LoRA serving: PEFT adapters on one base model, chosen per request.

- ``request``: ``LoRARequest``, the plain record naming a loaded adapter (crosses processes);
- ``adapter``: reading and validating a PEFT adapter directory against the model;
- ``layers``: linear layers with stacked adapter slots and a segmented (per-adapter) matmul;
- ``manager``: the worker's adapter slots on the device, LRU-swapped from a CPU cache.
"""
