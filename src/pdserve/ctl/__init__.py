"""`pdserve ctl`: an operator's view of a running cluster's worker pools, and role flips."""
