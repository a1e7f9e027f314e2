"""Tool calls: the request's tools checked, and the model's output read for calls."""
