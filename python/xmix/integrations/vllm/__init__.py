"""xmix inside vLLM: plugin (every process), worker side, engine core, frontend, server."""
