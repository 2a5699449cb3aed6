"""A testbed of hosts on one machine: a network namespace per host, joined through a bridge by
shaped links (`pdserve testbed`, docs/testbed.md).

`topology` names things and gives addresses, `shaping` writes the `tc` commands of a link,
`namespaces` runs `ip`/`tc` and enters namespaces, `lifecycle` builds and removes a testbed,
`state` is its small state file, `probe` measures a link, `cli` is the sub-command. Placing
`pdserve up`'s processes on the hosts is `cluster/testbed_hosts.py`'s (the cluster part
imports this one, never the reverse).
"""
