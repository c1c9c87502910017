"""The actors: the scheduler, the evaluator worker, the finalizer and the capture worker,
each a shell around pure decisions, run on ``engine.runtime``."""
