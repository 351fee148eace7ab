"""N-gram (prompt lookup) speculative decoding on the engine's side: the config's
checks (``config``), the proposer (``ngram``) and the per-request bookkeeping
(``speculator``). The runner verifies the drafts (model/draft_verify.py)."""
