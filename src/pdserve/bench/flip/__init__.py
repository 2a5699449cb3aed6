"""`pdserve bench flip`: live role flips under a streaming load on a real cluster; how long each
flip takes, whether any request failed or its greedy output changed, and the KV blocks still
held once idle.

Modules: `cli` (the options and settings, torch-free), `load` (the fixed prompts and the
streaming clients), `flips` (the flips through the router and what each took), `report` (the
summary and the goals), `run` (one whole run: start, references, load and flips, settle, tear
down).
"""
