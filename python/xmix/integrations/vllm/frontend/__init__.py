"""xmix in vLLM's frontend processes (LLM / AsyncLLM): the control plane,
the registry of deployed apps, admission of each request, results on the outputs."""
