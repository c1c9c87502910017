"""The actor runtime every actor runs on.

* ``consumer.GroupConsumer``: the consumer-group mechanics (own pending, then idle claims,
  then new entries; heartbeat; hand-back; dead-letter settling; reads that back off
  exponentially, capped, while Redis is away);
* ``loop.serve``: the actor loop on top of it (bounded concurrency, ack when a handler
  returns, release when it fails, hand back on stop) -- the scheduler, the evaluator
  worker, the finalizer and the capture worker bring only their handlers;
* ``appender.GroupAppender``: group-commit appends;
* ``follower.Follower``: a projection kept live from one stream (point reads for
  compare-and-append writers, blocking follows, waits on its changes) -- every reader of a
  stream outside a consumer group.
"""
