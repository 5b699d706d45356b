"""Embedded tiny models for tests and demos (no downloads)."""

from xmix.models.tiny import KINDS, make_tiny_model, tiny_model_path

__all__ = ["KINDS", "make_tiny_model", "tiny_model_path"]
