"""The vocabulary shared by the engine, the router, the OpenAI API layer and the planner.

Every module here imports without torch, so the router, `pdserve plan` and the CLI's argument
parsing start without loading it: sampling parameters, block hashes, a model's shape and folder,
the SmolLM2 conversion, tokenizer loading, and the engine option names (roles, dtypes, devices).
Torch-bound code (weights, kernels, the KV pool) stays in `pdserve.engine`.
"""
