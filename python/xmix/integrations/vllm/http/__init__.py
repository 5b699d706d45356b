"""xmix on vLLM's OpenAI-compatible server: routes, authentication, tenants,
the OpenAI requests' admission and results."""
