"""The names a request's read results travel under, one spelling each (the request's control
is ``request_controls.CONTROL_KEY``)."""

# On vLLM's outputs (RequestOutput, CompletionOutput) and in an OpenAI response's choice: the
# public name, what ``xmix.results(output)`` reads.
OUTPUT_ATTR = "xmix"
# Between the worker and the frontend: the attribute on ModelRunnerOutput, the engine core's
# store per request, and the key in EngineCoreOutput.kv_transfer_params (a private name no KV
# connector uses; the frontend removes it before anything in vLLM reads the dict).
CARRIER = "_xmix_results"
