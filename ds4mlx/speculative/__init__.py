"""Speculative decoding: a drafter proposes k tokens, the target verifies them
in one forward (`Session.verify`), the accepted prefix is kept and every cache rolled back
exactly past the first rejection (`Session.checkpoint` / `rollback`).

* `acceptance.py`: the acceptance rules (greedy = exact argmax match; sampled = standard
  speculative sampling, exact target distribution) and the sampler's distribution;
* `drafter.py`: where draft tokens come from (`--draft-model`: any model with the same
  tokenizer; a scripted drafter for tests);
* `loop.py`: `SpeculativeLoop`, the decode loop with the contract of decode.DecodeLoop
  (yields token ids, each already in the session; `settle()` drops what was not consumed);
* `options.py`: the flags (`--draft-model`, `--mtp-draft`, `--mtp-margin`) and the stats.
"""
