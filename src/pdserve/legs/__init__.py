"""The internal protocol between the router and its workers: one leg of a request
(`protocol.py`: `LegRequest`, `TokenEvent`, `EventBatch`) and the frames of the leg channel that
carries every leg a router has open on a worker (`frames.py`). Each end of the channel lives with
its process (`router/leg_client.py`, `workers/leg_channel.py`); the OpenAI surface (`api/`) only
reads the events. Torch-free: the router loads it. Re-exports nothing: import from the modules.
"""
