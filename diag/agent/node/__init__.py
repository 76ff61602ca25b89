"""The node's own probes, which precheck, health, taint and the options stand on: the NIC
that carries its traffic (carrier, address, speed) and the units of sizes and rates.
May import: formats.
"""
