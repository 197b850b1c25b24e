"""Multi-LoRA serving: PEFT adapters on one base model, chosen per request. By role:

- plain record: ``request`` (``LoRARequest``, crosses processes);
- front and core: ``files`` and ``checks`` (bounded reading and model-free rules), ``adapter``
  (reading and validating a PEFT adapter directory against the model);
- core: ``registry`` (the core's adapters), ``admission`` (the scheduler's LoRA rules, no torch);
- worker: ``layers`` (linear layers with stacked adapter slots, segmented matmul) and
  ``manager`` (the worker's device slots, LRU-swapped from a CPU cache).
"""
