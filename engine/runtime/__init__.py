"""The actor runtime: the consumer-group mechanics every actor shares (fetch own pending,
then idle claims, then new entries; heartbeat; hand-back; dead-letter settling), group-commit
appends, and live folds for compare-and-append writers."""
