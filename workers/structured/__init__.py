"""Structured output on the worker: grammar backends, their compile service, per-request
matchers and the token masks they give the sampler."""
