"""The actor runtime every actor runs on.

* ``consumer.GroupConsumer``: the consumer-group mechanics (own pending, then idle claims,
  then new entries; heartbeat; hand-back; dead-letter settling; reads that back off
  exponentially, capped, while Redis is away);
* ``loop.serve``: the actor loop on top of it (bounded concurrency, ack when a handler
  returns, release when it fails, hand back on stop) -- the scheduler, the evaluator
  worker, the finalizer and the capture worker bring only their handlers;
* ``appender.GroupAppender``: group-commit appends; ``live.LiveFold``: projections kept
  current from a stream's tail, for compare-and-append writers and point queries.
"""
