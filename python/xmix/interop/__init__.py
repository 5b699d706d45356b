"""Formats in: SAEs and control vectors from other tools, as xmix artifacts and apps.

    sae = xmix.interop.load_sae("path/to/saelens_or_sparsify_folder")      # -> xmix.SAE
    sae = xmix.interop.load_sae("gemma-scope-2b-pt-res/layer_12/width_16k/average_l0_82/params.npz")
    app = xmix.interop.load_vector_app("happy.gguf", scale=1.5)             # -> xmix.App
    app = xmix.interop.from_control_vector(repeng_vector)                  # repeng object
    app = xmix.interop.from_steering_vector(sv)                            # steering_vectors object

Importers read only data (safetensors, npz without pickle, GGUF, JSON) and refuse pickled
checkpoints with how to convert them. The command line is ``xmix import`` (docs/import.md).
"""

from xmix.interop._files import InteropError
from xmix.interop.hook_names import from_hf_module, from_transformer_lens
from xmix.interop.saes import detect_format, from_saelens_object, load_sae
from xmix.interop.vectors import (
    from_control_vector,
    from_steering_vector,
    load_vector_app,
    vectors_app,
)

__all__ = [
    "InteropError",
    "load_sae",
    "detect_format",
    "from_saelens_object",
    "load_vector_app",
    "vectors_app",
    "from_control_vector",
    "from_steering_vector",
    "from_transformer_lens",
    "from_hf_module",
]
