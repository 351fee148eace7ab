"""Speculative decoding on the engine's side: the config's checks (``config``), prompt
lookup's proposer (``ngram``) and the per-request bookkeeping (``speculator``), which
also keeps a draft model's proposals between steps. The runner runs the draft model
(model/runners/draft_model.py) and verifies the drafts (model/draft_verify.py)."""
