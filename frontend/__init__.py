"""DeepInfer's HTTP face: the OpenAI-compatible server, its CLI and the serving benchmark.

Nothing here imports torch or worker code: the server talks to the engine over ZeroMQ through
`engine.runtime.async_client.AsyncEngineClient`.
"""
