"""The serving simulator behind `pdserve simulate`: a discrete-event model of one trace served
on a cluster laid out disaggregated, collocated or collocated with chunked prefill. It owns the
trace (a workload preset, a JSONL file or a measured run replayed), the step costs (the
planner's roofline or a profile fitted to measured engine steps), the workers and the event loop,
and the metrics. Life cycle of one run: trace (trace.py, measured_run.py) -> events (events.py
pops arrivals, step ends and KV arrivals in time order on a cluster.py cluster; routing.py
chooses each request's workers, admission_gate.py admits it when the router's back-pressure is
modelled; pools.py runs each worker's steps, priced by calibration.py) -> metrics (metrics.py:
vLLM's bench serve percentiles, optionally set beside a measured run by measured_compare.py).
It shares the cost model, hardware, model shapes and KV math of `pdserve plan` in the parent
package and is imported by module, never through this package.
"""
