"""xmix in vLLM's engine processes: the worker (control block, model sites,
pipeline stages) and the engine core (results carried to the frontend)."""
