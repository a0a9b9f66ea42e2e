"""Chat protocols of the model families other than DeepSeek V4 (see chat/protocol.py)."""
