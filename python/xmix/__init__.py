"""xmix: serving-native mechanistic-interpretability apps for vLLM."""

__version__ = "0.1.0"
