"""What runs a lowered program inside an engine: the control block, the site op,
the CUDA graph splice, the device queue."""
