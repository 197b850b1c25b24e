"""tokenwire benchmarks (docs/benchmarks.md): workloads, the offline engine benchmark and its HF
baseline, the engine-overhead benchmark, the served benchmark against any gRPC or
OpenAI-compatible endpoint, and the roofline floor.

``bench/cli.py`` is the command-line edge (``tokenwire bench ...``): it turns parsed flags into
the frozen configs (``bench/configs.py``: ``ThroughputConfig``, ``OverheadConfig``,
``ServeBenchConfig``, ``LoRABenchConfig``) that every function below it takes."""
