"""DeepInfer's engine: protocol, config, tokenizer and scheduler processes, launcher, offline
API. The public API is re-exported by the `deepinfer` package (`from deepinfer import LLM`)."""
