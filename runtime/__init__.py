"""dflash.runtime: how dflash runs as processes (process.py: logs, std streams, signals, the spawn launcher, progress)
and what makes its files durable (atomic.py: writes and published folders; locks.py: file locks and live pids;
nested.py: flattened and compared nested records)."""
