"""`nixl._api`: nixl_cu12's, with one opt-in change.

PDSERVE_NIXL_PROGRESS_THREAD=0 makes `nixl_agent_config()` default to enable_prog_thread=False.
vLLM builds its agent config as nixl_agent_config(num_threads=..., capture_telemetry=True) and
offers no switch for it; nixl's default then starts a UCX progress thread that polls with zero
delay (nixl_cu12/_api.py sets pthrDelay = 0): it keeps most of a core busy even while idle,
and on a machine with one core per server that core is the one the model runs on. Without the
thread, UCX progresses when vLLM polls transfer states and notifications in its engine steps.
Unset or 1: nixl's own default, unchanged.
"""

import os

from nixl_cu12._api import *  # noqa: F403
from nixl_cu12._api import nixl_agent_config as _nixl_agent_config

if os.environ.get("PDSERVE_NIXL_PROGRESS_THREAD", "1") == "0":

    class nixl_agent_config(_nixl_agent_config):  # the name vLLM looks up
        def __init__(self, *args, enable_prog_thread: bool = False, **kwargs):
            super().__init__(*args, enable_prog_thread=enable_prog_thread, **kwargs)

else:
    nixl_agent_config = _nixl_agent_config
