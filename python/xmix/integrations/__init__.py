"""Engine integrations: ``hf`` (transformers, the research path and oracle) and ``vllm``."""
