"""Running a loaded model: the session (prefill, decode step, caches), the decode loop,
sampling, the tokenizer and detokenizer, steering, structured output and the engine's
event stream."""
