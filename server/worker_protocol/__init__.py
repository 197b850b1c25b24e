"""The vLLM engine worker protocol (``vllm.grpc.engine.VllmEngine`` from ``smg-grpc-proto``)
that gateways such as SMG and llm-d speak, served beside ``tokenwire.v1``."""
