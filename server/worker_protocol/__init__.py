"""The vLLM engine worker protocol (``vllm.grpc.engine.VllmEngine``) for gateways."""
