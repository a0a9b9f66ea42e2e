"""The disk KV cache: checkpoint file format, the checkpoint directory, when to save, the engine hooks."""
