"""build_engines: turn a checkpoint into a servable engine + Triton model repository and register it."""
