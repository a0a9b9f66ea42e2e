"""Chat protocols of each model family (see chat/protocol.py)."""
