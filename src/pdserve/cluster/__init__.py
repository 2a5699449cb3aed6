"""`pdserve up`: run a router and its workers as supervised processes on one machine."""
