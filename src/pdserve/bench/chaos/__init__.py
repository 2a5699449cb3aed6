"""`pdserve bench chaos`: a real cluster under a bounded streaming load while faults are
injected on a schedule; counts what every request became (ok, clean error, broken, hung) and
the KV blocks still held once the cluster is idle.

Modules: `schedule` (fault kinds and when each is injected), `stream` (one response stream
read and classified), `load` (the clients and their request mix), `workers` (the cluster's
workers as fault targets), `faults` (one injection per kind), `report` (the summary), `run`
(one whole run: start, load, faults, settle, tear down), `cli` (the command's options).
"""
